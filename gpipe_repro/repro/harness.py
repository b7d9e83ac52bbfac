"""What the benchmarks share: the MLP and its data, the baselines a pipeline is measured against, the
interleaved rounds inside stage processes (on :mod:`gpipe_repro.report.measurement`), the stop rule
and a benchmark's output.

Baselines (each ``step(x, y)`` one training step):

- :class:`PlainK1`: plain PyTorch, the whole model on the whole batch, one process (checkpoint
  "always": the model under torch.utils.checkpoint, the same extra forward the pipeline does);
- :class:`SameMicrobatchesK1`: the whole model on the same M micro-batches in one process (the local
  runtime running both cells in turn), so the per-sample cost, which depends on the micro-batch size,
  is the pipeline's; it can record each action's cost;
- :class:`Ours`: ``GPipe(..., runtime="distributed")`` on every rank, any schedule.
"""
from __future__ import annotations

import contextlib
import gc
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpipe_repro.distributed.measure import settle_garbage_collector
from gpipe_repro.models.mlp import synthetic_mlp
from gpipe_repro.report.measurement import Comparison, Figure, Progress, Rounds, StopRule, round_order


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def batch(width: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded batch of `rows` inputs of `width` features and 10-class labels."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, width, generator=g), torch.randint(0, 10, (rows,), generator=g)


def relu_mlp(width: int, depth: int, inplace: bool = False) -> list[nn.Module]:
    """`depth` x (Linear, ReLU) then a Linear to 10 classes, seeded."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU(inplace=inplace)]
    return layers + [nn.Linear(width, 10)]


class Checkpointed(nn.Module):
    """The wrapped module under torch.utils.checkpoint (non-reentrant): torch's re-materialization."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, x, use_reentrant=False)


class PlainK1:
    """K=1 baseline: plain PyTorch, the whole model on the whole batch."""

    def __init__(self, width: int, blocks: int, checkpoint: str = "never") -> None:
        self.model = nn.Sequential(*synthetic_mlp(width, blocks))
        self.run = Checkpointed(self.model) if checkpoint == "always" else self.model
        self.optimizer, self.loss_fn = sgd(self.model.parameters()), nn.CrossEntropyLoss()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_fn(self.run(x), y).backward()
        self.optimizer.step()


class SameMicrobatchesK1:
    """K=1 on the same M micro-batches: the local runtime runs the balanced cells in turn. With
    `record`, each action's cost per step is kept (``costs``: "kind/stage" -> seconds)."""

    def __init__(self, width: int, blocks: int, m: int, checkpoint: str = "never",
                 record: bool = False) -> None:
        from gpipe_repro import GPipe
        self.pipe = GPipe(synthetic_mlp(width, blocks), partitions=2, micro_batches=m,
                          balance=[blocks // 2] * 2, checkpoint=checkpoint,
                          loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
        self.pipe.record_timeline = record
        self.costs: dict[str, list[float]] = defaultdict(list)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pipe.train_step(x, y)
        if self.pipe.record_timeline and self.pipe.last_timeline is not None:
            for e in self.pipe.last_timeline.events:
                self.costs[f"{e.kind}/{e.stage}"].append(e.duration)


class Ours:
    """``GPipe(..., runtime="distributed", schedule=schedule)``: 2 processes, the model cut into
    equal cells (two per process for the interleaved and V schedules: cell c on process c mod 2 for
    interleaved, in a V for zb-v and dualpipe-v, cells 0 and 3 on process 0). The schedule's verdict
    on M (dualpipe-v: M >= 2K) comes before any step, as a ValueError."""

    def __init__(self, width: int, blocks: int, m: int, checkpoint: str = "never",
                 schedule: str = "gpipe", ahead: bool = False, prepost: bool = True) -> None:
        from gpipe_repro import GPipe
        from gpipe_repro.engine.schedule import cells_per_process
        k = 2 * cells_per_process(schedule)
        if blocks % k:
            raise ValueError(f"{blocks} blocks do not cut into {k} equal cells")
        self.pipe = GPipe(synthetic_mlp(width, blocks), partitions=k, micro_batches=m,
                          balance=[blocks // k] * k, checkpoint=checkpoint, schedule=schedule,
                          recompute_ahead=ahead, loss_fn=nn.CrossEntropyLoss(), optimizer=sgd,
                          runtime="distributed")
        self.pipe.make_schedule()
        from gpipe_repro.distributed.runtime import DistributedRuntime

        runtime = self.pipe.runtime
        assert isinstance(runtime, DistributedRuntime)
        runtime.transport.prepost = prepost

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pipe.train_step(x, y)


class OursAutoCut:
    """A user's default way: ``GPipe(layers, partitions, micro_batches=m, schedule=S, sample=one
    micro-batch, sample_target=its targets, checkpoint=C, runtime="distributed")``, 2 processes: cut
    by measured time (the default with a sample; the loss timed with the last layer; rank 0's cut on
    every rank), two cells per process for the interleaved and V schedules, a zero-bubble schedule
    with ``split_backwards="auto"`` (its count and cut from the same timings)."""

    def __init__(self, layers: Sequence[nn.Module], loss_fn: Any, m: int, schedule: str,
                 x: torch.Tensor, y: torch.Tensor, checkpoint: str = "never") -> None:
        from gpipe_repro import GPipe
        from gpipe_repro.engine.schedule import SPLIT_SCHEDULES, cells_per_process
        rows = max(1, x.shape[0] // m)
        self.pipe = GPipe(list(layers), partitions=2 * cells_per_process(schedule), micro_batches=m,
                          schedule=schedule, sample=x[:rows], sample_target=y[:rows],
                          checkpoint=checkpoint, loss_fn=loss_fn, optimizer=sgd, runtime="distributed",
                          split_backwards="auto" if schedule in SPLIT_SCHEDULES else None)
        self.pipe.make_schedule()
        self.balance = list(self.pipe.balance)
        self.split_backwards = self.pipe.split_backwards

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pipe.train_step(x, y)


TORCH_SINGLE = ("ScheduleGPipe", "Schedule1F1B")
TORCH_LOOPED = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble")
TORCH_V = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


class TorchSchedule:
    """A torch.distributed.pipelining schedule over this rank's stage(s) of the same model, 2
    processes: one stage each (TORCH_SINGLE), or the model cut into 4 chunks, chunk c on process
    c mod 2 (TORCH_LOOPED) or in a V, process 0 holding chunks 0 and 3 (TORCH_V). With checkpoint
    "always" each stage module runs under torch.utils.checkpoint."""

    def __init__(self, width: int, blocks: int, rank: int, m: int, name: str = "ScheduleGPipe",
                 checkpoint: str = "never") -> None:
        from torch.distributed import pipelining
        from torch.distributed.pipelining import PipelineStage

        layers, ranks = synthetic_mlp(width, blocks), 2
        chunks = ranks if name in TORCH_SINGLE else 2 * ranks
        if blocks % chunks:
            raise ValueError(f"{blocks} blocks do not cut into {chunks} equal chunks")
        per = blocks // chunks
        mine = ([rank] if name in TORCH_SINGLE else [rank, rank + ranks] if name in TORCH_LOOPED
                else [rank, chunks - 1 - rank])
        self.modules: list[nn.Module] = [nn.Sequential(*layers[c * per:(c + 1) * per]) for c in mine]
        wrapped = [Checkpointed(mod) if checkpoint == "always" else mod for mod in self.modules]
        stages = [PipelineStage(mod, c, chunks, torch.device("cpu")) for mod, c in zip(wrapped, mine)]
        target = stages[0] if name in TORCH_SINGLE else stages
        self.schedule = getattr(pipelining, name)(target, n_microbatches=m, loss_fn=nn.CrossEntropyLoss())
        self.first, self.last = 0 in mine, chunks - 1 in mine
        self.optimizer = sgd([p for mod in self.modules for p in mod.parameters()])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        args = (x,) if self.first else ()
        kwargs = {"target": y, "return_outputs": False} if self.last else {}
        self.schedule.step(*args, **kwargs)
        self.optimizer.step()


def rounds_in_processes(items: Mapping[str, Any], comparisons: Sequence[Comparison], rule: StopRule,
                        x: torch.Tensor, y: torch.Tensor, *, warmup: int = 1,
                        label: str = "rounds") -> dict[str, Any] | None:
    """Runs in every stage process: `warmup` untimed rounds, then timed rounds of every item (None:
    nothing on this rank, it waits in the barrier) in the kernel's order until rank 0's
    :class:`Rounds` stops (it decides, every rank follows). A round's time of an item: the last
    rank to finish minus the first to start (one host, one clock). Rank 0 returns the
    :class:`~gpipe_repro.report.measurement.Measurement` as JSON, the others None."""
    import torch.distributed as dist

    rank, names = dist.get_rank(), list(items)
    for i in range(warmup):
        for name in round_order(names, i):
            dist.barrier()
            if items[name] is not None:
                items[name].step(x, y)
    settle_garbage_collector()     # the start-up heap: collected once, not by the timed rounds
    rounds = Rounds(names, comparisons, rule) if rank == 0 else None
    progress = Progress(label) if rank == 0 else None
    try:
        with progress if progress is not None else contextlib.nullcontext():
            _run_rounds(items, names, rounds, progress, x, y)
    finally:   # a process that measures another group next can collect these items once dropped
        gc.unfreeze()
    return rounds.result().to_json() if rounds is not None else None


def _run_rounds(items: Mapping[str, Any], names: list[str], rounds: Rounds | None,
                progress: Progress | None, x: torch.Tensor, y: torch.Tensor) -> None:
    """The timed rounds of :func:`rounds_in_processes` (`rounds` and `progress` on rank 0 only)."""
    import torch.distributed as dist

    from gpipe_repro.report.host import fast_share

    index, stop = 0, [False]
    while not stop[0]:
        spans: dict[str, tuple[float, float]] = {}
        for name in round_order(names, index):
            dist.barrier()
            t0 = time.perf_counter()
            if items[name] is not None:
                items[name].step(x, y)
                spans[name] = (t0, time.perf_counter())
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, spans)
        if rounds is not None and progress is not None:
            rounds.record({n: max(s[n][1] for s in gathered if n in s) - min(s[n][0] for s in gathered
                                                                            if n in s)
                           for n in names}, fast_share())
            stop[0] = rounds.done()
            progress.update(rounds.status())
        dist.broadcast_object_list(stop, src=0)
        index += 1


def stop_rule(budget: float, tolerance: float, min_rounds: int, max_rounds: int, groups: int = 1) -> StopRule:
    """The stop rule of one of `groups` measured one after another (`budget` seconds for all)."""
    return StopRule(min_rounds=min_rounds, max_rounds=max_rounds, budget_s=budget / max(1, groups),
                    tolerance=tolerance)


def scaled(figure: Figure, name: str, factor: float, *, target: float | None = None,
           direction: str = ">=", tolerance: float = 0.02) -> Figure:
    """A figure of the same rounds, each sample times `factor` (e.g. a speedup over its ideal)."""
    return Figure.of(name, [s * factor for s in figure.samples], unit=figure.unit, target=target,
                     direction=direction, tolerance=tolerance, host_fast=figure.host_fast)


def verdict_lines(figures: Sequence[Figure]) -> str:
    """A markdown list: one line per figure."""
    return "\n".join(f"- {f.name}: {f.markdown()}" for f in figures)


def _published_by(path: Path, manifest: Path, command: str) -> bool:
    """Whether `path` is `command`'s earlier output: its JSON `manifest` (or `path` itself) stamped
    by it, or a benchmark JSON from before the stamps (a dict with "experiment" and no stamp); a
    page or chart is its if the manifest beside it is."""
    from gpipe_repro.report.output_guard import OWNER_KEY, owned_json, written_by
    if written_by(path) == command:
        return True
    return owned_json(manifest, command, lambda d: "experiment" in d and OWNER_KEY not in d)


def check_publish(experiment: str, stem: str, command: str, *, extra: Sequence[str] = (),
                  write: bool = True, clean: bool = True) -> None:
    """Before any work, where :func:`publish` will write (results/<experiment>/<stem>.{json,md} and
    the `extra` file names): refuse a file that is not `command`'s earlier output, and (`clean`) the
    results of record from a checkout whose tracked files differ from its commit (the stamps would
    name code that did not produce the figures). Exits with a message saying what to do."""
    if not write:
        return
    from gpipe_repro.report.output_guard import check_outputs
    from gpipe_repro.report.records import results_root
    out = results_root() / experiment
    paths = [out / f"{stem}.json", out / f"{stem}.md", *(out / name for name in extra)]
    try:
        check_outputs(paths, command=command, option="results", overwrite=True, record=True,
                      own=lambda path: _published_by(path, paths[0], command), clean=clean)
    except ValueError as e:
        raise SystemExit(f"{command}: {e}") from None


def publish(experiment: str, stem: str, payload: Mapping[str, Any], text: str, *,
            command: str, write: bool = True) -> None:
    """Print the page; write results/<experiment>/<stem>.{json,md} unless `write` is False (the
    command should have called :func:`check_publish` before its work; a file it did not write is
    refused again here).
    Every figure a benchmark publishes is measured: the JSON says so, with the environment it was
    taken in (device, host, torch, commit), unless the payload already does, and names `command`
    as its writer."""
    from gpipe_repro.report.output_guard import stamp
    from gpipe_repro.report.provenance import environment
    from gpipe_repro.report.records import results_dir, write_json, write_markdown
    print(text, flush=True)
    if write:
        # the checkout was checked clean before the work: a page edited since does not cost the run
        check_publish(experiment, stem, command, clean=False)
        out = results_dir(experiment)
        write_json(out / f"{stem}.json",
                   stamp({"method": "measured", "environment": environment(), **payload}, command))
        write_markdown(out / f"{stem}.md", text)
