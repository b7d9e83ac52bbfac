"""The per-device memory planner: each device's peak for K cells, M micro-batches, a schedule.

    planner = MemoryPlanner(layers, sample, target, loss_fn)      # layers may be on the meta device
    plan = planner.plan(partitions=8, micro_batches=32)           # a MemoryPlan: a peak per device
    plan.fits(8 * 2**30), plan.stages[3].parts                     # params, grads, optimizer, stash, ...

How: every distinct (layer, input) is profiled once under fake tensors
(:mod:`gpipe_repro.memory.profile`), the profiles are chained along the model for each micro-batch
size, and each stage's action list from the real :class:`~gpipe_repro.engine.schedule.Schedule` is replayed
over its cell's profiles (:mod:`gpipe_repro.memory.compose`); stages with identical cells and actions
are replayed once. So a plan for an 84B-parameter Transformer on 128 devices costs four layer
profiles and a few stage walks, seconds and well under a gigabyte. The planner's numbers are
*simulated*; :func:`gpipe_repro.memory.trace.trace_step` measures the real engine for comparison.

Conventions: a steady-state step (optimizer state exists; gradients are freed at the step's start
by the engine and re-created by the first backward); the caller's mini-batch lives on the first
device and the targets on the last (``data``); parameters are counted once per layer that owns them
(a parameter tied across cells is on every device holding a copy, as in the engine,
:mod:`gpipe_repro.engine.tied`; tied inside one cell it is counted once: :func:`shared_in_cell`).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from gpipe_repro.engine import microbatch
from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.partition import check_balance, partition
from gpipe_repro.engine.schedule import make_schedule, owner_of_cells
from gpipe_repro.engine.schedule.receive_window import receive_window
from gpipe_repro.memory.compose import (
    ACTIVATIONS,
    BUFFERS,
    DATA,
    OPTIMIZER,
    PARAMS,
    PERSISTENT,
    StageMemory,
    relabel,
    stage_key,
    walk_device,
    walk_stage,
)
from gpipe_repro.memory.profile import (
    LayerProfile,
    LossLayer,
    OptimizerFactory,
    ProfileCache,
    batchnorm_features,
    commit_transient,
    rmsprop,
)
from gpipe_repro.models.signature import LayerRun, compress, layer_key, microbatch_sig
from gpipe_repro.sim.tied import layer_ties

#: How values cross the cuts, for :meth:`MemoryPlanner.plan`'s `transport`.
TRANSPORTS = ("in-process", "nccl", "gloo")

GiB = 2 ** 30


def gib(nbytes: float) -> str:
    """`nbytes` in GiB, as a number: two decimals from 1 GiB up, three significant digits below (a
    budget of 0.01 GiB and a peak of 0.0129 must not both print as 0.01)."""
    x = nbytes / GiB
    return f"{x:.2f}" if abs(x) >= 1 else f"{x:.3g}"


def gib_apart(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` bytes as :func:`gib` writes them, with more digits where that would write two
    different sizes alike (a peak over its budget must not read "0.0024 of 0.0024")."""
    x, y = gib(a), gib(b)
    digits = 4
    while x == y and a != b and digits <= 12:
        x, y = (f"{v / GiB:.{digits}g}" for v in (a, b))
        digits += 1
    return x, y


def _data_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor))


def _meta(value: Any) -> Any:
    """Shapes and dtypes only."""
    return pytree.tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                           if isinstance(t, torch.Tensor) else t, value)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-device peaks of one configuration (all numbers simulated by the planner)."""

    partitions: int
    micro_batches: int
    checkpoint: str
    schedule: str
    balance: list[int]
    stages: list[StageMemory]          # peaks include the data parts
    parameters: int                    # parameter count of the whole model
    microbatch_sizes: list[int] = field(default_factory=list)
    state: list[int] = field(default_factory=list)   # per device: params + buffers + grads + optimizer
    split_backwards: int | None = None   # zero-bubble schedules: the last n backwards split (None: all)
    devices: list[StageMemory] = field(default_factory=list)   # several cells per device: each device's

    @property
    def device_of_cells(self) -> list[int]:
        """The device running each cell: one each, or several cells per device (interleaved round
        robin, zb-v and dualpipe-v in a V), as the schedule places them."""
        return owner_of_cells(self.schedule, len(self.stages))

    @property
    def device_peaks(self) -> list[int]:
        """Each device's peak: its cell's, or where a device runs several cells, the peak of their
        actions walked together in the order its process runs them (:func:`walk_device`)."""
        if self.devices:
            return [d.peak for d in self.devices]
        owner = self.device_of_cells
        peaks = [0] * (max(owner) + 1)
        for s in self.stages:
            peaks[owner[s.stage]] += s.peak
        return peaks

    @property
    def max_peak(self) -> int:
        """The largest device's peak (:attr:`device_peaks`)."""
        return max(self.device_peaks)

    @property
    def bottleneck_stage(self) -> int:
        return max(range(len(self.stages)), key=lambda s: self.stages[s].peak)

    def fits(self, budget_bytes: float) -> bool:
        return self.max_peak <= budget_bytes

    @property
    def state_memory(self) -> int:
        """Parameters, buffers, gradients and optimizer state, summed over devices (the paper's
        "param memory": 12 bytes per parameter with RMSProp)."""
        return sum(self.state)

    @property
    def activation_memory(self) -> int:
        """Sum over devices of each device's peak minus its persistent state and data."""
        return sum(s.activation_peak for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {"partitions": self.partitions, "micro_batches": self.micro_batches,
                "checkpoint": self.checkpoint, "schedule": self.schedule,
                "split_backwards": self.split_backwards, "balance": self.balance,
                "parameters": self.parameters, "microbatch_sizes": self.microbatch_sizes,
                "max_peak_bytes": self.max_peak, "device_peaks_bytes": self.device_peaks,
                "state_memory_bytes": self.state_memory,
                "activation_memory_bytes": self.activation_memory,
                "stages": [{"stage": s.stage, "peak_bytes": s.peak, "peak_at": s.peak_at,
                            "parts_bytes": dict(s.parts)} for s in self.stages]}


def shared_in_cell(ties: Sequence[tuple[float, Sequence[int]]], balance: Sequence[int]) -> dict[int, int]:
    """Bytes of parameters that a layer shares with a later layer of the same cell under the cut
    `balance` (`ties`: :func:`gpipe_repro.sim.tied.layer_ties`), by layer position. The cell holds one
    copy, one gradient and one optimizer state of each: the later holder counts them (its backward
    runs first, so makes the gradient), the earlier ones do not."""
    cell_of = [c for c, n in enumerate(balance) for _ in range(n)]
    out: dict[int, int] = {}
    for nbytes, at in ties:
        by_cell: dict[int, list[int]] = {}
        for i in sorted(set(at)):
            by_cell.setdefault(cell_of[i], []).append(i)
        for positions in by_cell.values():
            for i in positions[:-1]:
                out[i] = out.get(i, 0) + int(nbytes)
    return out


def without_shared(profile: LayerProfile, nbytes: int) -> LayerProfile:
    """`profile` less `nbytes` of parameters counted by another layer of its cell (see
    :func:`shared_in_cell`): their bytes, gradients and optimizer state (at the layer's own state per
    parameter byte)."""
    if not nbytes or not profile.param_bytes:
        return profile
    share = min(1.0, nbytes / profile.param_bytes)
    deferred = profile.deferred_grad_bytes - round(share * profile.deferred_grad_bytes)
    return dataclasses.replace(
        profile, param_bytes=profile.param_bytes - round(share * profile.param_bytes),
        grad_bytes=profile.grad_bytes - round(share * profile.grad_bytes),
        deferred_grad_bytes=deferred,
        deferred_grad_max_bytes=min(profile.deferred_grad_max_bytes, deferred),
        opt_state_bytes=profile.opt_state_bytes - round(share * profile.opt_state_bytes))


class MemoryPlanner:
    """Plans memory for one model and mini-batch shape (see the module docstring).

    `layers`: an ``nn.Sequential``, a list of modules, or a list of :class:`LayerRun` (a layer and
    how many identical copies follow each other; lets a search change L without building L layers).
    `sample` / `target`: the mini-batch (real, fake or meta tensors: only shapes and dtypes matter).
    `optimizer_foreach`: whether the optimizer step updates a cell's parameters in one multi-tensor
    pass (CUDA's default: its temporaries span the whole cell) or one tensor at a time (CPU).
    """

    def __init__(self, layers: nn.Sequential | Sequence[nn.Module] | Sequence[LayerRun], sample: Any,
                 target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: OptimizerFactory | None = rmsprop, attention: str = "fused",
                 optimizer_foreach: bool = False, cache: ProfileCache | None = None) -> None:
        items: list[nn.Module | LayerRun] = list(layers)
        if not items:
            raise ValueError("the model has no layers")
        runs = [i for i in items if isinstance(i, LayerRun)]
        modules = [i for i in items if not isinstance(i, LayerRun)]
        if runs and modules:
            raise TypeError("layers must be all modules or all LayerRuns, not a mix")
        self.runs: list[LayerRun] = runs or compress(modules)
        if not isinstance(target, torch.Tensor):
            raise TypeError("the planner needs the target as one tensor (batch first)")
        self.sample, self.target = _meta(sample), _meta(target)
        self.loss_fn, self.optimizer, self.attention = loss_fn, optimizer, attention
        self.optimizer_foreach = optimizer_foreach
        self.cache = cache if cache is not None else ProfileCache()
        self.batch = microbatch.batch_size(self.sample)
        self.num_layers = sum(r.count for r in self.runs)
        self._profiles: dict[int, list[LayerProfile]] = {}
        self._keys = [layer_key(r.layer) for r in self.runs]
        self._bn_features = [batchnorm_features(r.layer) for r in self.runs for _ in range(r.count)]
        seen: set[int] = set()
        total = 0
        for r in self.runs:
            own = [p for p in r.layer.parameters() if id(p) not in seen]
            seen.update(id(p) for p in own)
            total += r.count * sum(p.numel() for p in own)
        self.parameters = total
        # parameters held by several layers (tied embeddings): the simulator charges their all-reduce
        self.ties = layer_ties([r.layer for r in self.runs for _ in range(r.count)])

    # -- profiles -----------------------------------------------------------------------------------
    def profiles(self, size: int, flops: bool = False) -> list[LayerProfile]:
        """Profiles of every layer (then the loss) for a micro-batch of `size` examples."""
        if size not in self._profiles or (flops and not self._profiles[size][0].has_flops):
            sig = microbatch_sig(self.sample, size)
            out: list[LayerProfile] = []
            for run, key in zip(self.runs, self._keys):
                left = run.count
                while left:
                    p = self.cache.get(run.layer, sig, self.optimizer, self.attention, flops, key)
                    out.append(p)
                    left -= 1
                    if p.out_sig == p.in_sig:     # a fixed point: the remaining copies are equal
                        out.extend([p] * left)
                        left = 0
                    sig = p.out_sig
            target = torch.empty((size, *self.target.shape[1:]), dtype=self.target.dtype,
                                 device="meta")
            out.append(self.cache.get(LossLayer(self.loss_fn, target), sig, self.optimizer,
                                      self.attention, flops))
            self._profiles[size] = out
        return self._profiles[size]

    def sizes(self, micro_batches: int) -> list[int]:
        return microbatch.split_sizes(self.batch, micro_batches)

    def layer_memory(self, micro_batches: int, checkpoint: str) -> list[float]:
        """An additive per-layer memory estimate, for the partitioner (the plan itself is exact)."""
        size = max(self.sizes(micro_batches))
        profs = self.profiles(size)
        copies = micro_batches if checkpoint == "never" else 1
        mem = []
        for p in profs[:-1]:
            kept = p.saved_internal + p.out_new_bytes()
            mem.append(float(p.param_bytes + p.buffer_bytes + p.grad_bytes + p.opt_state_bytes
                             + copies * kept))
        loss = profs[-1]
        mem[-1] += float(copies * (loss.saved_internal + loss.fwd_peak))
        return mem

    def layer_flops(self, micro_batches: int) -> list[tuple[float, float]]:
        """(forward, backward) FLOPs of each layer (the loss folded into the last) per micro-batch."""
        profs = self.profiles(max(self.sizes(micro_batches)), flops=True)
        flops = [(float(p.fwd_flops), float(p.bwd_flops)) for p in profs[:-1]]
        f, b = flops[-1]
        flops[-1] = (f + profs[-1].fwd_flops, b + profs[-1].bwd_flops)
        return flops

    # -- plans --------------------------------------------------------------------------------------
    def candidate_balances(self, partitions: int, micro_batches: int, checkpoint: str) -> list[list[int]]:
        """Cuts worth planning: the exact bottleneck of the per-layer memory estimate, and the cut
        at equal shares of it (the estimate is additive; the plan is not, so both are planned)."""
        if partitions == 1:
            return [[self.num_layers]]
        memory = self.layer_memory(micro_batches, checkpoint)
        cuts = [partition(memory, partitions, "bottleneck"), partition(memory, partitions, "greedy")]
        return [c for i, c in enumerate(cuts) if c not in cuts[:i]]

    def plan(self, partitions: int, micro_batches: int, checkpoint: str = "except_last",
             balance: Sequence[int] | None = None, schedule: str = "gpipe",
             timeline: bool = False, split_backwards: int | None = None,
             transport: str = "in-process", budget: float | None = None) -> MemoryPlan:
        """Each device's peak memory for one training step (see the module docstring). Without a
        `balance`, the candidate cut with the smallest largest peak (then the most even peaks); with
        a `budget` (bytes per device) that it exceeds, the search goes on from it (:func:`_lower`)
        until a cut fits or no cut one layer away lowers the largest peak.
        `split_backwards`: a zero-bubble schedule splitting only its last micro-batches' backwards
        (:func:`gpipe_repro.engine.schedule.split_last`; None: every one). `transport`: how values
        cross the cuts (:data:`TRANSPORTS`): "in-process" (the local runtime) and "nccl" hand each
        over at its action; "gloo" (``runtime="distributed"`` on CPU) posts a few receives ahead of
        their actions and holds a sent value until the compute action after next, a few boundary
        values more per stage (:mod:`gpipe_repro.engine.schedule.receive_window`)."""
        require_one_of("transport", transport, TRANSPORTS)
        if partitions > self.num_layers:
            raise ValueError(f"partitions={partitions} is larger than the number of layers "
                             f"({self.num_layers})")
        if balance is not None:
            return self._plan(partitions, micro_batches, checkpoint, list(balance), schedule, timeline,
                              split_backwards, transport)
        def planned(cut: list[int]) -> MemoryPlan:
            return self._plan(partitions, micro_batches, checkpoint, cut, schedule, timeline,
                              split_backwards, transport)
        best = min((planned(cut) for cut in self.candidate_balances(partitions, micro_batches, checkpoint)),
                   key=_lowest)
        if budget is not None and best.max_peak > budget and partitions > 1:
            best = _lower(best, planned, budget)
        return best

    def _plan(self, partitions: int, micro_batches: int, checkpoint: str, balance: list[int],
              schedule: str, timeline: bool, split_backwards: int | None = None,
              transport: str = "in-process") -> MemoryPlan:
        sizes = self.sizes(micro_batches)
        by_size = {n: self.profiles(n) for n in set(sizes)}
        check_balance(balance, self.num_layers, partitions)
        sched = make_schedule(schedule, partitions, micro_batches, checkpoint,
                              split_backwards=split_backwards)
        ahead = receive_window(sched.programs(), micro_batches) if transport == "gloo" else None
        walked: dict[tuple, StageMemory] = {}
        stages: list[StageMemory] = []
        state: list[int] = []
        walk_args: dict[int, tuple[list[list[LayerProfile]], dict[str, int], int]] = {}
        start = 0
        shared = shared_in_cell(self.ties, balance)
        for s, n_layers in enumerate(balance):
            last = s == partitions - 1
            end = start + n_layers
            cell_of = {n: ([without_shared(q, shared.get(start + j, 0)) for j, q in enumerate(p[start:end])]
                           if shared else p[start:end]) + ([p[-1]] if last else [])
                       for n, p in by_size.items()}
            cells = [cell_of[n] for n in sizes]
            key = (stage_key(sched, s, cells), ahead)
            one = cell_of[sizes[0]]
            layers = one[:-1] if last else one
            base = {PARAMS: sum(p.param_bytes for p in layers),
                    BUFFERS: sum(p.buffer_bytes for p in layers),
                    OPTIMIZER: sum(p.opt_state_bytes for p in layers)}
            peaks = [p.opt_peak for p in layers] or [0]
            transient = max(sum(peaks) if self.optimizer_foreach else max(peaks),
                            commit_transient(sum(self._bn_features[start:end]), len(sizes)))
            walk_args[s] = (cells, base, transient)
            if key not in walked or timeline:
                walked[key] = walk_stage(sched, s, cells, base, transient, timeline, ahead)
            stages.append(self._with_data(relabel(walked[key], s), s, partitions))
            state.append(sum(p.param_bytes + p.buffer_bytes + p.grad_bytes + p.opt_state_bytes
                             for p in cell_of[sizes[0]][:n_layers]))
            start = end
        devices: list[StageMemory] = []
        if sched.processes is not None:     # several cells per device: walked together
            for p, program in enumerate(sched.programs()):
                held = sorted({a.stage for a in program})
                device = walk_device(sched, program, {s: walk_args[s][0] for s in held},
                                     {s: walk_args[s][1] for s in held}, {s: walk_args[s][2] for s in held},
                                     timeline, ahead, label=p)
                for s in held:
                    device = self._with_data(device, s, partitions)
                devices.append(device)
        return MemoryPlan(partitions, micro_batches, checkpoint, schedule, balance, stages,
                          self.parameters, sizes, state, split_backwards, devices)

    def _with_data(self, mem: StageMemory, stage: int, partitions: int) -> StageMemory:
        """`mem` with the caller's data on `stage`'s device: the mini-batch on the first stage's, the
        targets on the last's."""
        data = (_data_bytes(self.sample) if stage == 0 else 0) + (
            _data_bytes(self.target) if stage == partitions - 1 else 0)
        if not data:
            return mem
        parts = dict(mem.parts)
        parts[DATA] = parts.get(DATA, 0) + data
        return dataclasses.replace(mem, peak=mem.peak + data, parts=parts)


__all__ = ["MemoryPlanner", "MemoryPlan", "GiB", "PERSISTENT", "ACTIVATIONS"]


def _lowest(plan: MemoryPlan) -> tuple[float, float]:
    """A plan's order among cuts: the smallest largest peak, then the most even peaks."""
    return (float(plan.max_peak), sum(float(s.peak) ** 2 for s in plan.stages))


#: Plans the search from a cut that does not fit may make (each a few milliseconds).
SEARCH_PLANS = 400


def _lower(start: MemoryPlan, planned: Callable[[list[int]], MemoryPlan], budget: float) -> MemoryPlan:
    """From `start`'s cut, take one layer from a cell and give one to another (the cuts between
    them shift by one) to the neighbouring cut that lowers the largest peak most, until one fits
    in `budget` or none lowers it (or :data:`SEARCH_PLANS` plans were made). The per-layer
    estimate the first cuts come from is additive and position-free; the peaks are not: 1F1B
    keeps more micro-batches on the first stages, and a device of interleaved or zb-v holds two
    cells apart."""
    best, seen = start, {tuple(start.balance)}
    while best.max_peak > budget and len(seen) < SEARCH_PLANS:
        cut = list(best.balance)
        neighbours = []
        for i, j in itertools.permutations(range(len(cut)), 2):
            moved = list(cut)
            moved[i] -= 1
            moved[j] += 1
            if moved[i] >= 1 and tuple(moved) not in seen:
                seen.add(tuple(moved))
                neighbours.append(planned(moved))
        better = min(neighbours, key=_lowest, default=None)
        if better is None or _lowest(better) >= _lowest(best):
            break
        best = better
    return best

