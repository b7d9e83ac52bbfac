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

Results in results/overhead/ (measured).
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
import typer
from torch import nn

from experiments.command import Budget, MaxRounds, MinRounds, Tolerance, Write
from gpipe_repro import GPipe
from gpipe_repro.report.measurement import Comparison, measure
from gpipe_repro.report.records import markdown_table
from gpipe_repro.repro.harness import check_publish, publish, relu_mlp, sgd, stop_rule, verdict_lines

LABELS = {"plain": "plain PyTorch step", "plain clip": "plain step + clip_grad_norm_",
          "never": "GPipe K=1 M=1 checkpoint=never", "always": "GPipe K=1 M=1 checkpoint=always",
          "cut": "GPipe K=2 M=4, cut before ReLU",
          "inplace": "GPipe K=2 M=4, cut before ReLU(inplace): input copied",
          "clip": "GPipe K=1 M=1 clip_grad_norm=1"}
COMPARISONS = [
    Comparison("GPipe K=1 M=1 checkpoint=never / plain step", "never", "plain", 1.03, "<="),
    Comparison("GPipe K=1 M=1 checkpoint=always / plain step (recompute; paper ~1.25-1.33)",
               "always", "plain"),
    Comparison("cut before ReLU(inplace), input copied / cut before ReLU", "inplace", "cut"),
    Comparison("GPipe clip_grad_norm=1 (norm at AGREE) / plain step + clip_grad_norm_", "clip",
               "plain clip", 1.03, "<="),
]

COMMAND = "bench-overhead"


def timed(step: Callable[[], Any]) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0
    return run


def steps(width: int, depth: int, rows: int) -> dict[str, Callable[[], Any]]:
    """Every configuration's training step, by name."""
    x, y = torch.randn(rows, width), torch.randint(0, 10, (rows,))
    loss_fn = nn.CrossEntropyLoss()
    plain = nn.Sequential(*relu_mlp(width, depth))
    plain_opt = sgd(plain.parameters())

    def plain_step(clip: bool = False) -> None:
        plain_opt.zero_grad(set_to_none=True)
        loss_fn(plain(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()

    def pipe(layers: list[nn.Module], **kw: Any) -> Callable[[], Any]:
        p = GPipe(layers, loss_fn=loss_fn, optimizer=sgd, **kw)
        return lambda: p.train_step(x, y)

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
                         clip_grad_norm=1.0)}


app = typer.Typer(add_completion=False)


@app.command()
def main(width: int = typer.Option(1024, min=1, help="width of each Linear layer"),
         depth: int = typer.Option(6, min=1, help="Linear+ReLU layers"),
         batch: int = typer.Option(256, min=1, help="examples per step"),
         warmup: int = typer.Option(3, min=0, help="untimed steps of each before the rounds"),
         threads: int = typer.Option(1, min=1, help="torch CPU threads"),
         write: Write = True, budget: Budget = 120.0, tolerance: Tolerance = 0.01,
         min_rounds: MinRounds = 8, max_rounds: MaxRounds = 200) -> None:
    """The engine (K=1, M=1) against a plain PyTorch step, and the price of its guarantees."""
    check_publish("overhead", "overhead", COMMAND, write=write)
    torch.set_num_threads(threads)
    configs = steps(width, depth, batch)
    for _ in range(warmup):
        for step in configs.values():
            step()
    result = measure({n: timed(s) for n, s in configs.items()}, COMPARISONS,
                     stop_rule(budget, tolerance, min_rounds, max_rounds), label="bench-overhead")
    table = markdown_table(["step", "median ms [95% interval]"],
                           [[LABELS[n], f.markdown()] for n, f in result.times.items()])
    text = (f"# Engine overhead (measured)\n\nMLP {depth}x{width}, batch {batch}, "
            f"{threads} thread(s); {result.rounds} alternating rounds ({result.stopped}). Each "
            "ratio is the median of per-round paired ratios with its 95% bootstrap interval; a busy "
            "host widens the interval.\n\n" + verdict_lines(list(result.figures.values()))
            + "\n\n" + table)
    config = {"width": width, "depth": depth, "batch": batch, "warmup": warmup, "threads": threads,
              "budget": budget, "tolerance": tolerance, "min_rounds": min_rounds, "max_rounds": max_rounds}
    publish("overhead", "overhead", {"experiment": "engine overhead vs plain PyTorch",
                                     "config": config, "measurement": result.to_json()},
            text, command=COMMAND, write=write)


if __name__ == "__main__":
    app()
