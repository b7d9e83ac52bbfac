"""`make bench-compile`: what ``torch.compile`` buys the engine and plain PyTorch, and what the host's
reads of the loss cost a step.

Every comparison runs in alternating rounds of the measurement kernel
(:mod:`gpipe_repro.report.measurement`: a paired ratio per round, the median with a 95%
interval, a verdict against the target). A timed run is a block of training steps (per group, as
many as make its slowest configuration's block last ``--block-seconds``: a block far shorter than the
host's switches between its fast and slow state measures the switching) that ends waiting for the
device (``torch.cuda.synchronize`` on a GPU; the loss of the block's last step read once where the
step does not read it itself), so a step that only queues work is not timed as free. Five groups,
measured one after another, share the budget:

- **compile speedup** (a small ReLU MLP, and a small stack of ``nn.TransformerEncoderLayer`` blocks
  under a mean over the sequence and a Linear head): ``GPipe(..., compile=True)`` (inductor, each
  layer compiled on its own) against the same pipeline eager, at K=1 M=1 and at K=2 M=4 (the local
  runtime, one process); and plain PyTorch with ``torch.compile`` of the whole model (one graph)
  against plain eager. Target: eager time / compiled time >= 1.0.
- **launch-bound accumulation**: 32 micro-batches of 8 images through a small conv net (GPipe K=1
  M=32) against the plain step on the full batch of 256, eager, compiled, and each with
  ``train_step(..., sync=False)``.
- **where it goes**: one activation alone, training forward and backward at the MLP's activation
  size (ReLU, the MLP's; GELU, the Transformer's), compiled against eager. No target: it says how
  much of a compiled step a single elementwise layer costs (the compiled call's own overhead, and
  the code inductor generates for what the backward keeps: a ReLU keeps a mask of booleans).
- **host sync**: GPipe K=1 M=1 on a small MLP with ``train_step(..., sync=False)`` (the loss read
  once, at the end of the block) and with ``train_step(...)`` (a float every step), each against
  the plain step. Target on a GPU: sync=False / plain <= 1.05; on a CPU, where nothing runs ahead of
  the host, the figure is reported without a target.

Compilation is kept out of the rounds: every configuration is warmed up until a step compiles no
new graph (dynamo's count of unique graphs stops growing), and those warm-up seconds, compilation
included, are reported beside the rounds for every configuration, eager ones too. Inductor keeps
what it compiled on disk and reuses it in later processes; the run compiles into a fresh cache
directory of its own (what a first compile costs) unless ``--shared-cache`` (the user's cache: what
a repeated run costs). Within a run a configuration may still reuse what an earlier one compiled
(the same graph at the same shapes), as it would in a user's process.

``--tiny`` checks the script end to end in seconds: the ``aot_eager`` backend (no C compiler, no
code generation), the smallest models, 2 rounds per group. Results in results/compile/ (measured).
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import typer
from torch import nn

from experiments.bench_compile_models import TINY, Sizes, conv_net, transformer_blocks
from experiments.command import Budget, MaxRounds, MinRounds, Tolerance, Write
from gpipe_repro import GPipe
from gpipe_repro.report.measurement import Comparison, Measurement, StopRule, measure
from gpipe_repro.report.records import markdown_table
from gpipe_repro.repro.harness import check_publish, publish, relu_mlp, sgd, stop_rule, verdict_lines

GPU_SYNC_TARGET = 1.05
UNTIL_NO_NEW_GRAPH = 20
"""Warm-up steps at most: a configuration still compiling after this many is measured anyway (its
warm-up is reported as having reached the limit)."""

COMMAND = "bench-compile"


def wait(device: torch.device) -> None:
    """Until the device has run everything queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Step = Callable[[], Any]


def plain_step(layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor,
               options: dict[str, Any] | None) -> Step:
    """One plain PyTorch training step on the whole batch (with `options`: the whole model under
    ``torch.compile(**options)``, one graph); it reads nothing from the device."""
    model = nn.Sequential(*layers)
    run = torch.compile(model, **options) if options is not None else model
    optimizer, loss_fn = sgd(model.parameters()), nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(run(x), y).backward()
        optimizer.step()
    return step


def pipe_step(layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor, options: dict[str, Any] | None,
              partitions: int = 1, micro_batches: int = 1, sync: bool = True) -> Step:
    """One ``GPipe.train_step``, every cell on the batch's device (each layer under
    ``torch.compile(**options)`` with `options`); ``sync=False`` returns the loss as a tensor, unread."""
    pipe = GPipe(layers, partitions=partitions, micro_batches=micro_batches, checkpoint="never",
                 devices=[x.device] * partitions, loss_fn=nn.CrossEntropyLoss(), optimizer=sgd,
                 compile=options if options is not None else False)
    if sync:
        return lambda: pipe.train_step(x, y)
    return lambda: pipe.train_step(x, y, sync=False)


def activation_step(activation: nn.Module, x: torch.Tensor, options: dict[str, Any] | None) -> Step:
    """`activation` alone on `x` (a leaf that takes a gradient), forward and backward, as a layer of a
    training step runs it (with `options`: under ``torch.compile(**options)``)."""
    run = torch.compile(activation, **options) if options is not None else activation
    leaf = x.detach().clone().requires_grad_()
    grad = torch.ones_like(x)

    def step() -> None:
        leaf.grad = None
        run(leaf).backward(grad)
    return step


def timed_block(step: Step, steps: int, device: torch.device) -> Callable[[], float]:
    """A timed run: `steps` steps, then the last one's loss read (a tensor) and the device waited for."""
    def run() -> float:
        t0 = time.perf_counter()
        out = None
        for _ in range(steps):
            out = step()
        if isinstance(out, torch.Tensor):
            float(out)
        wait(device)
        return time.perf_counter() - t0
    return run


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def warm_up(step: Step, device: torch.device, at_least: int) -> dict[str, Any]:
    """Run `step` until one (after `at_least`) compiles no new graph: the seconds that took and the
    steps it ran, compilation included."""
    t0, count, last = time.perf_counter(), 0, 0.0
    while count < UNTIL_NO_NEW_GRAPH:
        before, began = graphs(), time.perf_counter()
        step()
        wait(device)
        count, last = count + 1, time.perf_counter() - began
        if count >= at_least and graphs() == before:
            break
    return {"seconds": time.perf_counter() - t0, "steps": count, "limit_reached": count >= UNTIL_NO_NEW_GRAPH,
            "last_step_seconds": last}


def steps_per_block(warm: dict[str, dict[str, Any]], block_seconds: float) -> int:
    """Steps that make the slowest configuration's block last about `block_seconds` (at least 1),
    from each configuration's last warm-up step."""
    slowest = max(w["last_step_seconds"] for w in warm.values())
    return max(1, math.ceil(block_seconds / slowest)) if slowest > 0 else 1


@contextlib.contextmanager
def compile_cache(fresh: bool) -> Iterator[str | None]:
    """With `fresh`, inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, Triton's under it) in a
    temporary directory for the duration, removed after; yields it (None: the cache as configured)."""
    if not fresh:
        yield None
        return
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="bench-compile-inductor-") as where:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = where
        try:
            yield where
        finally:
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


@dataclass(frozen=True)
class Group:
    """Configurations measured together in alternating rounds, their labels and comparisons."""

    name: str
    title: str
    steps: dict[str, Step]
    labels: dict[str, str]
    comparisons: list[Comparison]
    what: str


def speedup_group(name: str, title: str, layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor,
                  options: dict[str, Any], what: str, tolerance: float) -> Group:
    """Compiled against eager: plain (whole model), GPipe K=1 M=1 and K=2 M=4 (each layer)."""
    def fresh() -> list[nn.Module]:
        return copy.deepcopy(layers)

    steps = {"plain": plain_step(fresh(), x, y, None), "plain compiled": plain_step(fresh(), x, y, options),
             "k1": pipe_step(fresh(), x, y, None), "k1 compiled": pipe_step(fresh(), x, y, options),
             "k2": pipe_step(fresh(), x, y, None, 2, 4),
             "k2 compiled": pipe_step(fresh(), x, y, options, 2, 4)}
    labels = {"plain": "plain step, eager", "plain compiled": "plain step, torch.compile(whole model)",
              "k1": "GPipe K=1 M=1, eager", "k1 compiled": "GPipe K=1 M=1, compile (each layer)",
              "k2": "GPipe K=2 M=4, eager", "k2 compiled": "GPipe K=2 M=4, compile (each layer)"}
    comparisons = [
        Comparison(f"{title}: plain, torch.compile(whole model) speedup (eager / compiled)", "plain",
                   "plain compiled", 1.0, ">=", tolerance),
        Comparison(f"{title}: GPipe K=1 M=1 compile speedup (eager / compiled)", "k1", "k1 compiled",
                   1.0, ">=", tolerance),
        Comparison(f"{title}: GPipe K=2 M=4 compile speedup (eager / compiled)", "k2", "k2 compiled",
                   1.0, ">=", tolerance),
        Comparison(f"{title}: GPipe K=1 M=1 compiled / plain compiled", "k1 compiled", "plain compiled",
                   tolerance=tolerance),
    ]
    return Group(name, title, steps, labels, comparisons, what)


def groups(device: torch.device, sizes: Sizes, options: dict[str, Any], tolerance: float) -> list[Group]:
    """Every group of the benchmark, its models and batches on `device`."""
    def on(layers: list[nn.Module]) -> list[nn.Module]:
        return [layer.to(device) for layer in layers]

    def inputs_and_labels(rows: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return (torch.randn(rows, *shape, generator=g).to(device),
                torch.randint(0, 10, (rows,), generator=g).to(device))

    s = sizes
    x, y = inputs_and_labels(s.mlp_batch, (s.mlp_width,))
    mlp = speedup_group("mlp", "MLP", on(relu_mlp(s.mlp_width, s.mlp_depth)), x, y, options,
                        f"ReLU MLP {s.mlp_depth}x{s.mlp_width}, batch {s.mlp_batch}", tolerance)
    x, y = inputs_and_labels(s.transformer_batch, (s.sequence, s.model_dim))
    stack = on(transformer_blocks(s.model_dim, s.heads, s.blocks))
    blocks = speedup_group("transformer", "Transformer", stack, x, y, options,
                           f"{s.blocks} Transformer encoder block(s), d={s.model_dim}, {s.heads} heads, "
                           f"sequence {s.sequence}, batch {s.transformer_batch}",
                           tolerance)

    m, rows = s.micro_batches, s.micro_batches * s.images_per_micro_batch
    x, y = inputs_and_labels(rows, (3, s.image, s.image))
    conv = on(conv_net(s.channels))

    def fresh() -> list[nn.Module]:
        return copy.deepcopy(conv)

    launch = Group(
        "launch", "launch-bound accumulation",
        {"plain": plain_step(fresh(), x, y, None),
         "eager": pipe_step(fresh(), x, y, None, 1, m),
         "eager nosync": pipe_step(fresh(), x, y, None, 1, m, sync=False),
         "compiled": pipe_step(fresh(), x, y, options, 1, m),
         "compiled nosync": pipe_step(fresh(), x, y, options, 1, m, sync=False)},
        {"plain": f"plain step, full batch of {rows}", "eager": f"GPipe K=1 M={m}, eager",
         "eager nosync": f"GPipe K=1 M={m}, eager, sync=False",
         "compiled": f"GPipe K=1 M={m}, compile (each layer)",
         "compiled nosync": f"GPipe K=1 M={m}, compile (each layer), sync=False"},
        [Comparison(f"GPipe K=1 M={m} eager / plain full batch", "eager", "plain", tolerance=tolerance),
         Comparison(f"GPipe K=1 M={m} eager, sync=False / plain full batch", "eager nosync", "plain",
                    tolerance=tolerance),
         Comparison(f"GPipe K=1 M={m} compiled / plain full batch", "compiled", "plain", tolerance=tolerance),
         Comparison(f"GPipe K=1 M={m} compiled, sync=False / plain full batch", "compiled nosync", "plain",
                    tolerance=tolerance),
         Comparison(f"GPipe K=1 M={m} compile speedup (eager / compiled)", "eager", "compiled", 1.0, ">=",
                    tolerance)],
        f"conv net (2 convolutions of {s.channels} channels) on {s.image}x{s.image} images: {m} "
        f"micro-batches of {s.images_per_micro_batch} against the full batch of {rows}")

    x, _ = inputs_and_labels(s.mlp_batch, (s.mlp_width,))
    kinds = {"relu": nn.ReLU(), "gelu": nn.GELU()}
    activation = Group(
        "activation", "where it goes: one activation alone",
        {f"{kind}{suffix}": activation_step(module, x, opts) for kind, module in kinds.items()
         for suffix, opts in (("", None), (" compiled", options))},
        {"relu": "ReLU, eager", "relu compiled": "ReLU, compiled", "gelu": "GELU, eager",
         "gelu compiled": "GELU, compiled"},
        [Comparison("ReLU alone: compiled / eager", "relu compiled", "relu", tolerance=tolerance),
         Comparison("GELU alone: compiled / eager", "gelu compiled", "gelu", tolerance=tolerance)],
        f"one activation on {s.mlp_batch}x{s.mlp_width} (the MLP's), forward and backward with the "
        "input taking a gradient, as in a training step")

    x, y = inputs_and_labels(s.sync_batch, (s.sync_width,))
    small = on(relu_mlp(s.sync_width, 1))
    target = GPU_SYNC_TARGET if device.type == "cuda" else None
    sync = Group(
        "sync", "host sync",
        {"plain": plain_step(copy.deepcopy(small), x, y, None),
         "sync": pipe_step(copy.deepcopy(small), x, y, None),
         "nosync": pipe_step(copy.deepcopy(small), x, y, None, sync=False)},
        {"plain": "plain step", "sync": "GPipe K=1 M=1, train_step (a float every step)",
         "nosync": "GPipe K=1 M=1, train_step(sync=False) (read once per block)"},
        [Comparison("GPipe K=1 M=1 sync=False / plain step", "nosync", "plain", target, "<=", tolerance),
         Comparison("GPipe K=1 M=1 float every step / plain step", "sync", "plain", tolerance=tolerance),
         Comparison("GPipe K=1 M=1 float every step / sync=False", "sync", "nosync", tolerance=tolerance)],
        f"ReLU MLP 1x{s.sync_width}, batch {s.sync_batch}, eager")
    return [mlp, blocks, launch, activation, sync]


def render(device: torch.device, backend: str, steps: dict[str, int],
           results: list[tuple[Group, Measurement]], warm: dict[str, dict[str, dict[str, Any]]],
           host: dict[str, Any]) -> str:
    """The page: per group the verdicts, then every configuration's time and warm-up."""
    commit = host.get("git_commit") or "unknown"
    dirty = " (dirty tree)" if host.get("git_dirty") else ""
    lines = ["# torch.compile and host sync (measured)\n",
             f"Device {device.type} ({host['device']}), {host['cores']} usable core(s), "
             f"{torch.get_num_threads()} torch thread(s), load average {host['load_start']:.1f} at the "
             f"start and {host['load_end']:.1f} at the end; commit {commit[:10]}{dirty}; torch "
             f"{torch.__version__}, backend {backend}, {host['compile_cache']} compile cache. "
             "A timed run is a block of steps (per group) "
             "ending with the device waited for. Each ratio is the median of per-round paired ratios "
             "with its 95% interval; a busy host widens the interval. Compilation is outside "
             "the rounds: its warm-up seconds (until a step compiles no new graph) are in the tables."]
    for group, result in results:
        lines += [f"\n## {group.title}\n", f"{group.what}; blocks of {steps[group.name]} step(s), "
                  f"{result.rounds} alternating rounds "
                  f"({result.stopped}).\n", verdict_lines(list(result.figures.values())), ""]
        rows = []
        for name, figure in result.times.items():
            w = warm[group.name][name]
            rows.append([group.labels[name], figure.markdown(),
                         f"{w['seconds']:.1f} ({w['steps']} steps{', limit' if w['limit_reached'] else ''})"])
        per = f"median time per {steps[group.name]} step(s) [95% interval]"
        lines.append(markdown_table(["configuration", per, "warm-up seconds (compilation included)"], rows))
    return "\n".join(lines)


def run(device: str = "cpu", budget: float = 240.0, out_dir: str | Path | None = None, tiny: bool = False,
        *, write: bool = True, tolerance: float = 0.02, min_rounds: int = 6, max_rounds: int = 200,
        steps: int | None = None, block_seconds: float = 0.05, mode: str | None = None,
        shared_cache: bool = False) -> dict[str, Any]:
    """The whole benchmark on `device` ("cpu" or "cuda"): its payload (the page is printed; with
    `write`, written to `out_dir`/bench_compile.{json,md}, by default results/compile/).
    `steps`: steps per timed block in every group (None: from `block_seconds`); `shared_cache`:
    compile into inductor's cache as configured, not a fresh one (:func:`compile_cache`). `tiny`: the
    aot_eager backend, the smallest models, 2 rounds per group, 1 step per block."""
    from gpipe_repro.report.provenance import environment
    from gpipe_repro.report.records import write_json, write_markdown

    where = torch.device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("--device cuda: no CUDA device here")
    if out_dir is None:
        check_publish("compile", "bench_compile", COMMAND, write=write)
    backend = "aot_eager" if tiny else "inductor"
    options: dict[str, Any] = {"backend": backend}
    if mode is not None:
        options["mode"] = mode
    sizes = TINY if tiny else Sizes()
    if tiny:
        min_rounds = max_rounds = 2
    env = environment()
    host = {"device": env["device"], "cores": env["cores"], "load_start": os.getloadavg()[0],
            "git_commit": env.get("git_commit"), "git_dirty": env.get("git_dirty"),
            "compile_cache": "shared" if shared_cache or tiny else "fresh"}
    all_groups = groups(where, sizes, options, tolerance)
    warm: dict[str, dict[str, dict[str, Any]]] = {}
    results: list[tuple[Group, Measurement]] = []
    block: dict[str, int] = {}
    with compile_cache(not shared_cache and not tiny):
        for group in all_groups:
            warm[group.name] = {name: warm_up(step, where, 1 if tiny else 3)
                                for name, step in group.steps.items()}
            block[group.name] = (steps if steps is not None else 1 if tiny
                                 else steps_per_block(warm[group.name], block_seconds))
            rule: StopRule = stop_rule(budget, tolerance, min_rounds, max_rounds, len(all_groups))
            result = measure({n: timed_block(s, block[group.name], where) for n, s in group.steps.items()},
                             group.comparisons, rule, label=f"bench-compile {group.name}")
            results.append((group, result))
    host["load_end"] = os.getloadavg()[0]
    text = render(where, backend, block, results, warm, host)
    config = {"device": device, "tiny": tiny, "backend": backend, "mode": mode, "steps_per_block": block,
              "block_seconds": block_seconds, "compile_cache": host["compile_cache"],
              "sizes": sizes.__dict__, "threads": torch.get_num_threads(), "budget": budget,
              "tolerance": tolerance, "min_rounds": min_rounds, "max_rounds": max_rounds}
    payload = {"experiment": "torch.compile speedup, launch-bound accumulation, host sync",
               "method": "measured", "config": config, "host": host,
               "groups": {g.name: {"what": g.what, "labels": g.labels, "warm_up": warm[g.name],
                                   "measurement": r.to_json()} for g, r in results}}
    if out_dir is None:
        publish("compile", "bench_compile", payload, text, command=COMMAND, write=write)
    else:
        print(text, flush=True)
        if write:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            write_json(out / "bench_compile.json", payload)
            write_markdown(out / "bench_compile.md", text)
    return payload


app = typer.Typer(add_completion=False)


@app.command()
def main(device: str = typer.Option("cpu", help="cpu or cuda (a lent GPU host runs the same script)"),
         tiny: bool = typer.Option(False, "--tiny", help="seconds: aot_eager backend, smallest models, "
                                   "2 rounds per group (checks the script, measures nothing of note)"),
         steps: int = typer.Option(0, min=0, help="training steps per timed run in every group (0: "
                                   "from --block-seconds; 1 with --tiny)"),
         block_seconds: float = typer.Option(0.05, min=0.0, help="seconds a timed block of the "
                                             "slowest configuration of a group lasts (sets its steps)"),
         mode: str = typer.Option("", help="torch.compile mode (empty: its default)"),
         threads: int = typer.Option(1, min=1, help="torch CPU threads"),
         out_dir: Path = typer.Option(None, help="where to write (default results/compile/)"),
         shared_cache: bool = typer.Option(False, "--shared-cache", help="compile into inductor's "
                                           "cache as configured (what a repeated run pays), not a "
                                           "fresh one (what a first compile pays)"),
         write: Write = True, budget: Budget = 150.0, tolerance: Tolerance = 0.02,
         min_rounds: MinRounds = 6, max_rounds: MaxRounds = 200) -> None:
    """torch.compile against eager (GPipe and plain PyTorch), launch-bound accumulation, host sync."""
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device {device!r}: use cpu or cuda")
    torch.set_num_threads(threads)
    run(device, budget, out_dir, tiny, write=write, tolerance=tolerance, min_rounds=min_rounds,
        max_rounds=max_rounds, steps=steps or None, block_seconds=block_seconds,
        mode=mode or None, shared_cache=shared_cache)


if __name__ == "__main__":
    app()
