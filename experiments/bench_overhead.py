"""`make bench-overhead`: what the engine costs when there is nothing to pipeline.

Side by side, in alternating rounds of the measurement kernel (:mod:`gpipe_repro.report.measurement`:
a paired ratio per round, the median with a 95% interval): a plain PyTorch training step (zero_grad,
forward, loss, backward, optimizer step) against `GPipe` with K=1, M=1 on the same model, batch and
thread count. Target: ratio <= 1.03 with checkpoint="never". The same with re-materialization on
(checkpoint="always") shows the recompute cost (the paper's: about 25-33%).

Two more pairs price the engine's guarantees, each against its own baseline in the same rounds:

- in-place layers: GPipe K=2 M=4 cut right before a ``ReLU(inplace=True)`` (that cell's input is
  copied for every forward and recompute) against the same cut with ``ReLU()`` (no copy; only the
  version-counter check, which every cell pays);
- global clipping: GPipe K=1 M=1 with ``clip_grad_norm`` (the global norm computed at AGREE) against
  a plain step with ``torch.nn.utils.clip_grad_norm_``.

And the launch-bound case, where the engine's fixed cost per step is all there is to see: GPipe K=1
M=1 (checkpoint="never") on a ReLU MLP 1x64 with a batch of 32 against the plain step, each run as a
block of steps; target <= 1.05, with the engine's own microseconds per step (the paired per-round
difference).

Results in results/overhead/ (measured).
"""
from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import typer
from torch import nn

from experiments.command import Budget, MaxRounds, MinRounds, Tolerance, Write
from gpipe_repro import GPipe
from gpipe_repro.report.measurement import Comparison, Measurement, measure, median_interval
from gpipe_repro.report.records import markdown_table
from gpipe_repro.repro.harness import check_publish, publish, relu_mlp, sgd, stop_rule, verdict_lines

LABELS = {"plain": "plain PyTorch step", "plain clip": "plain step + clip_grad_norm_",
          "never": "GPipe K=1 M=1 checkpoint=never", "always": "GPipe K=1 M=1 checkpoint=always",
          "cut": "GPipe K=2 M=4, cut before ReLU",
          "inplace": "GPipe K=2 M=4, cut before ReLU(inplace): input copied",
          "clip": "GPipe K=1 M=1 clip_grad_norm=1",
          "tiny plain": "launch-bound tiny MLP: plain PyTorch step",
          "tiny": "launch-bound tiny MLP: GPipe K=1 M=1 checkpoint=never"}
COMPARISONS = [
    Comparison("GPipe K=1 M=1 checkpoint=never / plain step", "never", "plain", 1.03, "<="),
    Comparison("GPipe K=1 M=1 checkpoint=always / plain step (recompute; paper ~1.25-1.33)",
               "always", "plain"),
    Comparison("cut before ReLU(inplace), input copied / cut before ReLU", "inplace", "cut"),
    Comparison("GPipe clip_grad_norm=1 (norm at AGREE) / plain step + clip_grad_norm_", "clip",
               "plain clip", 1.03, "<="),
    Comparison("launch-bound tiny MLP: GPipe K=1 M=1 / plain step", "tiny", "tiny plain", 1.05, "<="),
]

COMMAND = "bench-overhead"


def timed(step: Callable[[], Any], repeat: int = 1) -> Callable[[], float]:
    """One run: `repeat` steps, timed together."""
    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(repeat):
            step()
        return time.perf_counter() - t0
    return run


def plain_steps(layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor,
                loss_fn: nn.Module) -> Callable[..., None]:
    """The plain step (zero_grad, forward, loss, backward, [clip], optimizer step) of `layers`."""
    model = nn.Sequential(*layers)
    opt = sgd(model.parameters())

    def step(clip: bool = False) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return step


def steps(width: int, depth: int, rows: int, tiny_width: int = 64,
          tiny_rows: int = 32) -> dict[str, Callable[[], Any]]:
    """Every configuration's training step, by name."""
    x, y = torch.randn(rows, width), torch.randint(0, 10, (rows,))
    tx, ty = torch.randn(tiny_rows, tiny_width), torch.randint(0, 10, (tiny_rows,))
    loss_fn = nn.CrossEntropyLoss()
    plain = relu_mlp(width, depth)
    plain_step = plain_steps(plain, x, y, loss_fn)
    tiny = relu_mlp(tiny_width, 1)
    tiny_plain = plain_steps(copy.deepcopy(tiny), tx, ty, loss_fn)

    def pipe(layers: list[nn.Module], **kw: Any) -> Callable[[], Any]:
        p = GPipe(layers, loss_fn=loss_fn, optimizer=sgd, **kw)
        return lambda: p.train_step(x, y)

    tiny_pipe = GPipe(tiny, partitions=1, micro_batches=1, checkpoint="never", loss_fn=loss_fn,
                      optimizer=sgd)
    cut = [1, 2 * depth]      # right before the first ReLU: the in-place one opens cell 1
    return {"plain": plain_step, "plain clip": lambda: plain_step(True),
            "never": pipe(copy.deepcopy(list(plain)), partitions=1, micro_batches=1, checkpoint="never"),
            "always": pipe(copy.deepcopy(list(plain)), partitions=1, micro_batches=1,
                           checkpoint="always"),
            "cut": pipe(relu_mlp(width, depth), partitions=2, micro_batches=4, balance=cut,
                        checkpoint="except_last"),
            "inplace": pipe(relu_mlp(width, depth, True), partitions=2, micro_batches=4, balance=cut,
                            checkpoint="except_last"),
            "clip": pipe(copy.deepcopy(list(plain)), partitions=1, micro_batches=1, checkpoint="never",
                         clip_grad_norm=1.0),
            "tiny plain": tiny_plain, "tiny": lambda: tiny_pipe.train_step(tx, ty)}


def overhead_line(result: Measurement, tiny_steps: int) -> str:
    """The engine's own microseconds per step on the tiny MLP: the median of the per-round paired
    differences (GPipe - plain) over a block, with its 95% interval."""
    ours, plain = result.times["tiny"].samples, result.times["tiny plain"].samples
    per_step = [(a - b) / tiny_steps * 1e6 for a, b in zip(ours, plain)]
    low, high, _ = median_interval(per_step)
    span = "" if low is None or high is None else f" [{low:.0f}, {high:.0f}]"
    return (f"- launch-bound tiny MLP: the engine's own time per step (GPipe - plain): "
            f"{statistics.median(per_step):.0f} us{span} (plain {min(plain) / tiny_steps * 1e6:.0f} us "
            "per step at best)")


app = typer.Typer(add_completion=False)


@app.command()
def main(width: int = typer.Option(1024, min=1, help="width of each Linear layer"),
         depth: int = typer.Option(6, min=1, help="Linear+ReLU layers"),
         batch: int = typer.Option(256, min=1, help="examples per step"),
         warmup: int = typer.Option(3, min=0, help="untimed steps of each before the rounds"),
         threads: int = typer.Option(1, min=1, help="torch CPU threads"),
         tiny_width: int = typer.Option(64, min=1, help="the launch-bound MLP's width (1 layer)"),
         tiny_batch: int = typer.Option(32, min=1, help="the launch-bound MLP's batch"),
         tiny_steps: int = typer.Option(50, min=1, help="the launch-bound MLP's steps per timed run"),
         write: Write = True, budget: Budget = 120.0, tolerance: Tolerance = 0.01,
         min_rounds: MinRounds = 8, max_rounds: MaxRounds = 200) -> None:
    """The engine (K=1, M=1) against a plain PyTorch step, and the price of its guarantees."""
    check_publish("overhead", "overhead", COMMAND, write=write)
    torch.set_num_threads(threads)
    configs = steps(width, depth, batch, tiny_width, tiny_batch)
    for _ in range(warmup):
        for step in configs.values():
            step()
    repeat = {"tiny": tiny_steps, "tiny plain": tiny_steps}
    result = measure({n: timed(s, repeat.get(n, 1)) for n, s in configs.items()}, COMPARISONS,
                     stop_rule(budget, tolerance, min_rounds, max_rounds), label="bench-overhead")
    table = markdown_table(["step", "median ms [95% interval]"],
                           [[LABELS[n], f.markdown()] for n, f in result.times.items()])
    text = (f"# Engine overhead (measured)\n\nMLP {depth}x{width}, batch {batch}, "
            f"{threads} thread(s); {result.rounds} alternating rounds ({result.stopped}). Each "
            "ratio is the median of per-round paired ratios with its 95% interval; a busy "
            "host widens the interval.\n\n" + verdict_lines(list(result.figures.values()))
            + "\n" + overhead_line(result, tiny_steps)
            + f"\n\nThe tiny MLP (1x{tiny_width}, batch {tiny_batch}) runs {tiny_steps} steps per timed "
            "run.\n\n" + table)
    config = {"width": width, "depth": depth, "batch": batch, "warmup": warmup, "threads": threads,
              "tiny_width": tiny_width, "tiny_batch": tiny_batch, "tiny_steps": tiny_steps,
              "budget": budget, "tolerance": tolerance, "min_rounds": min_rounds, "max_rounds": max_rounds}
    publish("overhead", "overhead", {"experiment": "engine overhead vs plain PyTorch",
                                     "config": config, "measurement": result.to_json()},
            text, command=COMMAND, write=write)


if __name__ == "__main__":
    app()
