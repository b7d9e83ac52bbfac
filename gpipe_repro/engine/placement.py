"""Where the cells go: which layers form each cell, which process runs which stage (the runtime,
the processes of one pipeline, the replicas), and on which device each cell lives.

With ``runtime="local"`` one process runs every stage. With ``runtime="distributed"`` each pipeline
has one process per stage, or K = partitions / v processes with ``schedule="interleaved"`` (each
runs its v cells round robin, ``Schedule.process_of()``); a job of R replicas has that many
processes times R, and ``rank = replica * processes + process`` (see
:mod:`gpipe_repro.distributed.groups`). :func:`place_stages` checks the job against that and says
which stages this process keeps.

The distributed runtime lives in a later layer (``gpipe_repro.distributed``, which imports the
engine); the engine names it here and loads it only when a user asks for it, as torch loads its
backends. The module provides ``init_distributed()``, ``broadcast_object()``, ``gather_object()``,
``Layout`` and ``DistributedRuntime``.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.schedule import num_processes, owner_of_cells
from gpipe_repro.engine.traced import has_values

__all__ = ["RUNTIMES", "Placement", "place_stages", "runtime_plugin", "split_cells", "move_cell"]

RUNTIMES = ("local", "distributed")
_RUNTIME_PLUGINS = {"distributed": "gpipe_repro.distributed.runtime"}


def runtime_plugin(runtime: str) -> Any:
    """The module that implements `runtime`, imported on first use; None for ``"local"``."""
    if runtime not in _RUNTIME_PLUGINS:
        return None
    return importlib.import_module(_RUNTIME_PLUGINS[runtime])


@dataclass(frozen=True)
class Placement:
    """Where the stages of one GPipe run.

    Attributes:
        processes: the processes of one pipeline (K; ``partitions`` unless stages share processes).
        process_of: ``process_of[s]``, the process (index in its pipeline) running stage s.
        stages_here: the stages this process runs (all of them with the local runtime).
        rank: this process's index in its pipeline (its stage, or with ``"interleaved"`` its first
            stage); None with the local runtime.
        replica: this process's replica (0 with the local runtime).
        plugin: the distributed runtime's module, or None.
        context: the distributed runtime's context of this process (rank, world size, device), or
            None.
    """
    processes: int
    process_of: list[int]
    stages_here: list[int]
    rank: int | None = None
    replica: int = 0
    plugin: Any = None
    context: Any = None

    def same_on_every_rank(self, value: Any) -> Any:
        """Rank 0's `value` on every process (a collective with the distributed runtime); `value`
        itself with the local runtime."""
        return value if self.plugin is None else self.plugin.broadcast_object(value)

    def check_same_on_every_rank(self, value: Any, what: str) -> None:
        """Raise ValueError on every rank (a collective with the distributed runtime) unless every
        process was given the same `value`; `what` names it (a GPipe argument) in the message. A
        dict is compared key by key, and the message names the first key that differs."""
        if self.plugin is None:
            return
        values = self.plugin.gather_object(value)
        if all(v == values[0] for v in values):
            return
        differ = next(r for r, v in enumerate(values) if v != values[0])
        first, other = values[0], values[differ]
        if isinstance(first, dict) and isinstance(other, dict):
            what = next(k for k in first if first.get(k) != other.get(k))
            first, other = first[what], other.get(what)
        if what == "layers" and isinstance(other, list) and len(first) == len(other):
            first, other = next((a, b) for a, b in zip(first, other) if a != b)   # the first that differs
        fix = ("build the same model on every rank (each layer's index, type and parameter shapes "
               "are shown)" if what == "layers" else f"pass the same {what} everywhere" + (
                   " (or leave it out everywhere: the engine chooses it, and rank 0's choice is used)"
                   if what in ("balance", "cost", "split_backwards") else ""))
        def short(value: Any) -> str:
            text = repr(value)
            return text if len(text) <= 300 else text[:300] + " ..."
        raise ValueError(f"the ranks were given different {what}: rank 0 {short(first)}, rank "
                         f"{differ} {short(other)}. Every rank must build the same pipeline: {fix}")

    def check_same_optimizers(self, signatures: Sequence[Any]) -> None:
        """Raise ValueError on every rank (a collective with the distributed runtime) unless every
        process built its cells' optimizers by the same rule (:func:`~gpipe_repro.engine.arguments.
        optimizer_signature`; a process whose cells have no parameters builds none): a cell given
        another learning rate or optimizer on one rank trained under another rule, and a replica or
        a tied copy drifted from its twins, silently."""
        if self.plugin is None:
            return
        mine = sorted({repr(s): s for s in signatures}.values(), key=repr)
        values = self.plugin.gather_object(mine)
        built = [(r, v) for r, v in enumerate(values) if v]
        if not built:        # optimizer=None everywhere: gradients only
            return
        (first, ours), differ = built[0], next(((r, v) for r, v in built[1:] if v != built[0][1]), None)
        if differ is None:
            return
        r, theirs = differ
        a, b = ours[0], theirs[0]          # the first rule of each (one, unless cells differ)
        if a[0] != b[0]:
            shown = f"rank {first} {a[0]}, rank {r} {b[0]}"
        else:
            keys = [k for k in sorted(set(a[1]) | set(b[1])) if a[1].get(k) != b[1].get(k)]
            shown = ", ".join(f"{k} {a[1].get(k)!r} on rank {first}, {b[1].get(k)!r} on rank {r}"
                              for k in keys) or f"rank {first} {ours!r}, rank {r} {theirs!r}"
        raise ValueError(f"the ranks built different optimizers ({shown}). Every rank must pass the "
                         "same optimizer factory (the same class and settings): each cell, replica "
                         "and tied copy is updated by its own process")

    def check_same_weights(self, cells: Sequence[nn.Module], ties: Sequence[Any]) -> None:
        """Raise ValueError on every rank (a collective with the distributed runtime) unless the
        processes that hold the same weights built them alike: the replicas of a stage (its cell's
        parameters and buffers) and the holders of a parameter tied across processes (each keeps
        its own copy, :mod:`~gpipe_repro.engine.tied`). Otherwise they would train from different
        values with nothing to say so (DDP broadcasts rank 0's weights; the engine leaves the model
        as given, and checks). A rank's weights of cells it does not run are not compared (they
        may be left unloaded). Compared: each tensor's float64 sum."""
        if self.plugin is None:
            return
        held = [(f"cell {s}'s {name}", t) for s in self.stages_here
                for name, t in [*cells[s].named_parameters(), *cells[s].named_buffers()]]
        held += [(f"the tied parameter {tie.holders[0][1]} (cell {tie.holders[0][0]})",
                  cells[c].get_parameter(name)) for tie in ties for c, name in tie.holders
                 if c in self.stages_here]
        kept = [(n, t) for n, t in held if has_values(t) and not nn.parameter.is_lazy(t)]
        sums = torch.stack([_fingerprint(t) for _, t in kept]).cpu().tolist() if kept else []
        mine: dict[str, float] = {}
        for (name, _), value in zip(kept, sums):
            mine.setdefault(name, value)     # a process holding two copies of a tie: they are equal
        every = self.plugin.gather_object(mine)
        first: dict[str, tuple[int, float]] = {}
        for rank, theirs in enumerate(every):
            for name, value in theirs.items():
                seen = first.setdefault(name, (rank, value))
                if seen[1] != value and not (value != value and seen[1] != seen[1]):   # NaN alike
                    raise ValueError(
                        f"ranks {seen[0]} and {rank} hold {name} with different values: the processes "
                        "holding the same weights (the replicas of a stage, the copies of a tied "
                        "parameter) must start equal. Seed every rank alike before building the model "
                        "(torch.manual_seed) or load the same weights everywhere")


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A tensor's sum in float64, accumulated without a float64 copy of it (an 8B model's embedding
    would be 4 GiB more on its device)."""
    x = t.detach()
    return (torch.view_as_real(x) if x.is_complex() else x).sum(dtype=torch.float64)


def place_stages(*, runtime: str, schedule: str, partitions: int, checkpoint: str,
                 replicas: int) -> Placement:
    """Place `partitions` stages on processes for `runtime` (the arguments are GPipe's, already
    checked by :func:`~gpipe_repro.engine.arguments.check_arguments`). With the distributed runtime
    this starts the process group (``init_distributed``) and checks the job's size: raises
    ValueError, saying how many processes to start, for a job that does not match K x R, and for
    replicas of a pipeline whose processes hold several stages (checked before the process group)."""
    plugin = runtime_plugin(runtime)
    # The processes of one pipeline: one per partition, or K = partitions / v with "interleaved"
    # (its v cells per process, round robin) and the V schedules (2 per process); owner[s] is the
    # process running cell s.
    procs = partitions if plugin is None else num_processes(schedule, partitions)
    owner = list(range(partitions)) if procs == partitions else owner_of_cells(schedule, partitions)
    if procs != partitions and replicas > 1:
        raise ValueError(f"schedule={schedule!r} with replicas={replicas}: replicas of a pipeline "
                         "whose processes hold several cells are not supported (each stage's "
                         "gradient all-reduce is per cell); use replicas=1, or schedule='1f1b'")
    if plugin is None:
        return Placement(procs, owner, list(range(partitions)))
    context = plugin.init_distributed()
    world = context.world_size
    per = "partition" if procs == partitions else f"pair of cells ({schedule!r} puts 2 per process)"
    if world % procs != 0:
        raise ValueError(f"partitions={partitions} but the job has {world} processes, which is "
                         f"not a multiple of {procs}: start one process per {per} and "
                         f"replica, {procs} x replicas processes (torchrun "
                         f"--nproc-per-node {procs}, or launch_local(fn, {procs} * R))")
    if world != procs * replicas:
        if procs != partitions:     # several cells per process: replicas are no way out
            each = partitions // procs
            raise ValueError(f"partitions={partitions} with schedule={schedule!r}, which puts {each} cells "
                             f"on each process, needs {procs} processes but the job has {world}: pass "
                             f"partitions={each * world} ({world} processes of {each} cells each), or "
                             f"start {procs} processes")
        raise ValueError(f"partitions={partitions} x replicas={replicas} needs "
                         f"{procs * replicas} processes but the job has {world}: start "
                         f"{procs * replicas} processes, or pass replicas={world // procs}")
    rank, replica = context.rank % procs, context.rank // procs
    return Placement(procs, owner, [s for s in range(partitions) if owner[s] == rank], rank, replica,
                     plugin, context)


def split_cells(layers: list[nn.Module], balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut `layers` into cells of `balance` layers each (the same module objects)."""
    cells, i = [], 0
    for n in balance:
        cells.append(nn.Sequential(*layers[i:i + n]))
        i += n
    return cells


def move_cell(cell: nn.Module, device: torch.device) -> nn.Module:
    """`cell` on `device`, moved only if some tensor of it is elsewhere (fake tensors cannot swap
    storages)."""
    tensors = [*cell.parameters(), *cell.buffers()]
    return cell if all(t.device == device for t in tensors) else cell.to(device)
