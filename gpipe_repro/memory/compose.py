"""Composing layer profiles along a schedule: one stage's memory over its actions.

A stage's memory is a function of its cell and its action list, nothing else (every stage has its own
device). :func:`walk_stage` replays the stage's actions from :class:`~gpipe_repro.engine.schedule.Schedule`
the way :class:`~gpipe_repro.engine.stage.StageExecutor` executes them, with symbolic storages in place of
tensors: each has a size and a set of holders (the stash ``inputs[m]``, the ``outbox``, the cell's
output kept in ``graphs[m]``, the graph of layer j for micro-batch m, the gradient buffers, the
running value of the forward loop). A storage is freed when its last holder lets go, exactly as
reference counting frees a tensor. Inside a layer, the profile's measured peak is added on top.

So the planner consumes the schedule as data (no copy of its logic) and its answer can be checked
against the real engine run under a tracker (:mod:`gpipe_repro.memory.trace`).

Categories at the peak: ``params``, ``buffers``, ``grads``, ``optimizer`` (persistent), ``stash``
(boundary inputs kept for the backward: O(M) per stage), ``activations`` (the working set: graphs
kept for the backward, temporaries, gradients in flight, BatchNorm statistics).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from gpipe_repro.engine.schedule import COMPUTE, Action, ActionKind, Schedule
from gpipe_repro.memory.profile import LayerProfile
from gpipe_repro.models.signature import ValueSig

PARAMS, BUFFERS, GRADS, OPTIMIZER = "params", "buffers", "grads", "optimizer"
STASH, ACTIVATIONS, DATA = "stash", "activations", "data"
PERSISTENT = (PARAMS, BUFFERS, GRADS, OPTIMIZER)


@dataclass(frozen=True)
class StageMemory:
    """One stage's (one device's) memory over a training step."""

    stage: int
    peak: int
    parts: dict[str, int]                       # category -> bytes at the peak
    peak_at: str                                # the action during which the peak happens
    timeline: list[tuple[str, int, int]] = field(default_factory=list)  # (action, after, peak)
    activation_high: int | None = None          # the largest activation bytes at any moment

    @property
    def persistent(self) -> int:
        return sum(self.parts.get(c, 0) for c in PERSISTENT)

    @property
    def activation_peak(self) -> int:
        """The most activation memory (stash + working set) held at any moment: the paper's "peak
        activation memory". Without a walk's record, the peak minus persistent state and data."""
        if self.activation_high is not None:
            return self.activation_high
        return self.peak - self.persistent - self.parts.get(DATA, 0)


class _Store:
    """Symbolic storages with holders; live bytes by category; the running peak."""

    def __init__(self, base: dict[str, int]) -> None:
        self.parts: dict[str, int] = defaultdict(int, base)
        self.live = sum(base.values())
        self.size: dict[int, int] = {}
        self.category: dict[int, str] = {}
        self.holders: dict[int, set[Hashable]] = defaultdict(set)
        self.held: dict[Hashable, set[int]] = defaultdict(set)
        self.peak, self.peak_parts, self.peak_at = self.live, dict(self.parts), "start"
        self.window = self.live
        self.activation_high = 0
        self._next = 0

    def new(self, nbytes: int, category: str, holder: Hashable) -> int:
        sid = self._next
        self._next += 1
        self.size[sid], self.category[sid] = nbytes, category
        self.add(category, nbytes)
        self.hold(sid, holder)
        return sid

    def add(self, category: str, nbytes: int) -> None:
        self.live += nbytes
        self.parts[category] += nbytes
        self.touch(0, "")

    def hold(self, sid: int, holder: Hashable) -> None:
        self.holders[sid].add(holder)
        self.held[holder].add(sid)

    def release(self, holder: Hashable) -> None:
        for sid in self.held.pop(holder, ()):
            hs = self.holders[sid]
            hs.discard(holder)
            if not hs:
                del self.holders[sid]
                self.live -= self.size[sid]
                self.parts[self.category[sid]] -= self.size[sid]

    def rename(self, old: Hashable, new: Hashable) -> None:
        for sid in self.held.pop(old, ()):
            self.holders[sid].discard(old)
            self.hold(sid, new)

    def touch(self, transient: int, where: str, category: str = ACTIVATIONS) -> None:
        """A moment at which `transient` bytes (of `category`) exist on top of the live ones."""
        now = self.live + transient
        self.window = max(self.window, now)
        activations = self.live - sum(self.parts[c] for c in PERSISTENT)
        if category not in PERSISTENT:
            activations += transient
        self.activation_high = max(self.activation_high, activations)
        if now > self.peak:
            self.peak, self.peak_at = now, where or self.peak_at
            self.peak_parts = {k: v for k, v in self.parts.items() if v}
            if transient:
                self.peak_parts[category] = self.peak_parts.get(category, 0) + transient


def boundary_grad_bytes(sig: ValueSig) -> int:
    """Bytes of the gradients that come back for a value crossing a cell boundary."""
    seen: set[int] = set()
    total = 0
    for t in sig.tensors:
        if t.dtype.is_floating_point and t.group not in seen:
            seen.add(t.group)
            total += t.nbytes
    return total


def boundary_bytes(sig: ValueSig) -> int:
    """Bytes a received value occupies (each storage group copied once)."""
    seen: set[int] = set()
    total = 0
    for t in sig.tensors:
        if t.group not in seen:
            seen.add(t.group)
            total += t.nbytes
    return total


def walk_stage(schedule: Schedule, stage: int, cells: Sequence[Sequence[LayerProfile]],
               base: dict[str, int], optimizer_transient: int, timeline: bool = False,
               receives_ahead: int | None = None) -> StageMemory:
    """Replay `stage`'s actions of `schedule`; `cells[m]` are the cell's layer profiles for
    micro-batch m (the last stage's end with the loss). `base`: persistent bytes by category
    (parameters, buffers, optimizer state); gradients are added by the first backward.

    `receives_ahead`: None, a value is received at its action and a sent one let go at once (one
    process; NCCL). A number, the distributed runtime on gloo (:mod:`gpipe_repro.distributed.transport`):
    that many receives of each kind are posted (their buffers allocated) at the step's start, the
    next as one is used, and a sent value is held until the compute action after next."""
    return walk_device(schedule, schedule.stages[stage], {stage: cells}, {stage: base},
                       {stage: optimizer_transient}, timeline, receives_ahead, label=stage)


def walk_device(schedule: Schedule, program: Sequence[Action],
                cells: Mapping[int, Sequence[Sequence[LayerProfile]]], bases: Mapping[int, dict[str, int]],
                optimizer_transients: Mapping[int, int], timeline: bool = False,
                receives_ahead: int | None = None, label: int = 0) -> StageMemory:
    """One device's memory over its process's `program` (:meth:`Schedule.programs`): the actions of
    each stage it holds (``cells[stage]``, ``bases[stage]``, ``optimizer_transients[stage]``, as
    :func:`walk_stage` takes them for one) walked together, in the order the process runs them, on
    one store: a device holding two cells (interleaved, zb-v, dualpipe-v) peaks when what both hold
    at one moment does, not at the sum of their peaks. `label`: the stage number the result carries."""
    base: dict[str, int] = defaultdict(int)
    for b in bases.values():
        for category, nbytes in b.items():
            base[category] += nbytes
    st = _Store(dict(base))
    walks = {s: _CellWalk(_Holders(st, s), schedule, s, cells[s], optimizer_transients[s], receives_ahead)
             for s in cells}
    events: list[tuple[str, int, int]] = []
    computes = 0
    for action in program:
        st.window = st.live
        if action.kind in COMPUTE:
            computes += 1
        walks[action.stage].step(action, computes)
        if timeline:
            events.append((str(action), st.live, st.window))
    return StageMemory(label, st.peak, st.peak_parts, st.peak_at, events, st.activation_high)


class _Holders:
    """A store seen by one stage of a device: its holders tagged with the stage, so that two cells'
    micro-batch m hold apart."""

    def __init__(self, store: _Store, stage: int) -> None:
        self.store, self.stage = store, stage

    def new(self, nbytes: int, category: str, holder: Hashable) -> int:
        return self.store.new(nbytes, category, (self.stage, holder))

    def hold(self, sid: int, holder: Hashable) -> None:
        self.store.hold(sid, (self.stage, holder))

    def release(self, holder: Hashable) -> None:
        self.store.release((self.stage, holder))

    def rename(self, old: Hashable, new: Hashable) -> None:
        self.store.rename((self.stage, old), (self.stage, new))

    def add(self, category: str, nbytes: int) -> None:
        self.store.add(category, nbytes)

    def touch(self, transient: int, where: str, category: str = ACTIVATIONS) -> None:
        self.store.touch(transient, where, category)


class _CellWalk:
    """One stage's actions replayed on a (shared) store: what :class:`StageExecutor` holds and frees
    at each (see the module docstring and :func:`walk_stage`)."""

    def __init__(self, st: _Holders, schedule: Schedule, stage: int,
                 cells: Sequence[Sequence[LayerProfile]], optimizer_transient: int,
                 receives_ahead: int | None) -> None:
        self.st, self.cells, self.stage = st, cells, stage
        self.optimizer_transient, self.receives_ahead = optimizer_transient, receives_ahead
        self.ahead: dict[ActionKind, list[int]] = {ActionKind.RECV_ACT: [], ActionKind.RECV_GRAD: []}
        for action in schedule.stages[stage]:
            if action.kind in self.ahead and action.microbatch is not None:
                self.ahead[action.kind].append(action.microbatch)
        self.posted: dict[tuple[ActionKind, int], list[int]] = {}
        for kind in self.ahead:
            for _ in range(receives_ahead or 0):
                self._post(kind)
        self.held: list[tuple[Hashable, int]] = []   # sent values in flight: (holder, compute actions before)
        self.first, self.last = stage == 0, stage == schedule.num_stages - 1
        self.checkpointed = schedule.checkpointed(stage)
        self.training = schedule.training
        self.inputs: dict[int, list[int]] = {}
        self.grads_in: dict[int, int] = {}
        self.have_grads = self.have_state = False
        self.have_input_grads = False      # the gradients a zero-bubble I makes (what it does not defer)

    def _buffers(self, kind: ActionKind, m: int) -> list[int]:
        """The storages a receive of `kind` for micro-batch m fills: the stash, or the gradient."""
        if kind is ActionKind.RECV_ACT:
            return [self.st.new(b, STASH, ("stash", m)) for b in _group_copy_bytes(self.cells[m][0].in_sig)]
        return [self.st.new(boundary_grad_bytes(self.cells[m][-1].out_sig), ACTIVATIONS, ("gin", m))]

    def _received(self, kind: ActionKind, m: int) -> list[int]:
        """At a receive: its buffers (posted earlier, or now), and the channel's next one posted."""
        got = self.posted.pop((kind, m), None)
        if got is None:
            got = self._buffers(kind, m)
        self._post(kind)
        return got

    def _post(self, kind: ActionKind) -> None:
        if self.receives_ahead is not None and self.ahead[kind]:
            m = self.ahead[kind].pop(0)
            self.posted[(kind, m)] = self._buffers(kind, m)

    def step(self, action: Action, computes: int) -> None:
        """`action`, the process's `computes`-th compute action or after it."""
        st, cells, first = self.st, self.cells, self.first
        m, kind, where = action.microbatch, action.kind, str(action)
        if self.receives_ahead is not None and kind in COMPUTE:
            for holder, _ in [h for h in self.held if h[1] <= computes - 2]:
                st.release(holder)
            self.held = [h for h in self.held if h[1] > computes - 2]
        if kind is ActionKind.AGREE:
            return          # the barrier before the update: a few float64 numbers all-reduced
        if kind is ActionKind.OPTIMIZER_STEP:
            st.touch(self.optimizer_transient, where, OPTIMIZER)
            if self.have_state:  # DeferredBatchNorm commits and drops its statistics
                st.add(ACTIVATIONS, -sum(p.state_bytes for p in cells[-1]))
            return
        if m is None:       # every other action belongs to a micro-batch
            raise ValueError(f"stage {self.stage}: action {where} has no micro-batch")
        if kind is ActionKind.RECV_ACT:
            self.inputs[m] = self._received(kind, m)
        elif kind is ActionKind.FORWARD or kind is ActionKind.RECOMPUTE:
            if first and m not in self.inputs:   # the caller's mini-batch: data, counted apart
                self.inputs[m] = [st.new(0, STASH, ("stash", m)) for _ in cells[m][0].in_sig.group_bytes]
            keep = kind is ActionKind.RECOMPUTE or (self.training and m not in self.checkpointed)
            fed = self.inputs[m]
            if first:   # stage 0 feeds its cell a copy of the caller's batch (StageExecutor._copies)
                fed = [st.new(b, ACTIVATIONS, ("feed", m)) for b in _group_copy_bytes(cells[m][0].in_sig)]
            out = _forward(st, cells[m], fed, m, keep, where)
            st.release(("feed", m))     # what the graph saved of the copy stays with the graph
            if kind is ActionKind.FORWARD and not self.have_state:
                st.add(ACTIVATIONS, sum(p.state_bytes for p in cells[m]))  # BatchNorm statistics
                self.have_state = True
            if keep:
                for sid in out:
                    st.hold(sid, ("cell", m))
            if kind is ActionKind.FORWARD and not self.last:
                for sid in out:
                    st.hold(sid, ("outbox", m))
            st.release(("var", m))
        elif kind is ActionKind.SEND_ACT:
            _sent(st, self.held, ("outbox", m), self.receives_ahead, computes)
        elif kind is ActionKind.RECV_GRAD:
            self.grads_in[m] = self._received(kind, m)[0]
        elif kind is ActionKind.BACKWARD:
            _backward(st, cells[m], m, self.grads_in.get(m), accumulate=self.have_grads, send=not first,
                      where=where)
            self.have_grads = True
            for holder in (("cell", m), ("gin", m), ("stash", m), ("var", m)):
                st.release(holder)
        elif kind is ActionKind.BACKWARD_INPUT:
            # The zero-bubble split (Qi et al., ICLR 2024). Stage 0 computes nothing at I (its whole
            # backward runs at W, as StageExecutor does). Elsewhere the cell's backward runs now
            # without the deferred weight gradients (engine.backward_split): its graph goes, and
            # until W each deferred linear or convolution keeps its input and its output's gradient
            # (the profiles' deferred_bytes).
            if not first:
                _backward(st, cells[m], m, self.grads_in.get(m), accumulate=True, send=True, where=where)
                if not self.have_grads and not self.have_input_grads:
                    st.add(GRADS, sum(p.grad_bytes - p.deferred_grad_bytes for p in cells[m]))
                self.have_input_grads = True
                st.new(sum(p.deferred_bytes for p in cells[m]), ACTIVATIONS, ("graph", m, 0))
                for name in ("cell", "gin", "stash", "var"):
                    st.release((name, m))
        elif kind is ActionKind.BACKWARD_WEIGHT:
            if first:
                _backward(st, cells[m], m, self.grads_in.get(m), accumulate=self.have_grads, send=False,
                          where=where)
            elif not self.have_grads:
                st.add(GRADS, sum(p.deferred_grad_bytes for p in cells[m]))
            else:   # each module's new gradients exist beside its .grad until added into it
                st.touch(max((p.deferred_grad_max_bytes for p in cells[m]), default=0), where)
            self.have_grads = True
            for name in ("cell", "gin", "stash", "var"):
                st.release((name, m))
            for j in range(len(cells[m])):
                st.release(("graph", m, j))
        elif kind is ActionKind.SEND_GRAD:
            _sent(st, self.held, ("gout", m), self.receives_ahead, computes)


def _sent(st: _Holders, held: list[tuple[Hashable, int]], holder: Hashable, receives_ahead: int | None,
          computes: int) -> None:
    """A value sent: let go now (one process), or held as a gloo send in flight (see walk_stage)."""
    if receives_ahead is None:
        st.release(holder)
        return
    sending = ("sending", holder)
    st.rename(holder, sending)
    held.append((sending, computes))


def _group_copy_bytes(sig: ValueSig) -> list[int]:
    """Per storage group, what a received copy occupies (a view is copied as its elements)."""
    sizes: dict[int, int] = {}
    for t in sig.tensors:
        sizes.setdefault(t.group, t.nbytes)
    return [sizes.get(g, b) for g, b in enumerate(sig.group_bytes)]


def _forward(st: _Holders, layers: Sequence[LayerProfile], x: list[int], m: int, keep: bool,
             where: str) -> list[int]:
    cur = list(x)
    for sid in cur:
        st.hold(sid, ("var", m))
    for j, p in enumerate(layers):
        st.touch(p.fwd_peak if keep else p.nograd_peak, where)
        out = []
        for g, origin in enumerate(p.out_origin):
            if origin is None:
                out.append(st.new(p.out_sig.group_bytes[g], ACTIVATIONS, ("next", m)))
            else:
                st.hold(cur[origin], ("next", m))
                out.append(cur[origin])
        if keep:
            tag = ("graph", m, j)
            if p.saved_internal:
                st.new(p.saved_internal, ACTIVATIONS, tag)
            for g in p.saved_in:
                st.hold(cur[g], tag)
            for g in p.saved_out:
                st.hold(out[g], tag)
        st.release(("var", m))
        st.rename(("next", m), ("var", m))
        cur = out
    return cur


def _backward(st: _Holders, layers: Sequence[LayerProfile], m: int, grad_in: int | None,
              accumulate: bool, send: bool, where: str, hold_graph: bool = False) -> None:
    """Walk a cell's backward layer by layer. `hold_graph` (a zero-bubble input-gradient pass): the
    layers' saved tensors stay (for the weight pass) and no parameter gradient is created yet."""
    n = len(layers)
    # Gradients of the current layer's output groups (the cell's: what the next stage sent).
    out_grads: dict[int, int] = ({g: grad_in for g in range(len(layers[-1].out_origin))}
                                 if grad_in is not None else {})
    for j in reversed(range(n)):
        p = layers[j]
        st.touch(p.bwd_peak[int(accumulate)][int(j == n - 1)], where)
        # After the layer's backward (its peak is the profile's): its graph and its output's
        # gradients are gone, its input's gradients and (first time) its parameters' exist.
        in_grads: dict[int, int] = {}
        holder = ("buf", m, j - 1) if j > 0 else ("gout", m)
        for g, origin in enumerate(p.in_grads):
            if origin is not None and origin[0] == "out" and origin[1] in out_grads:
                st.hold(out_grads[origin[1]], holder)       # passed through: the same storage
                in_grads[g] = out_grads[origin[1]]
        if not hold_graph:
            st.release(("graph", m, j))
        st.release(("buf", m, j))
        for g, origin in enumerate(p.in_grads):
            if origin is not None and origin[0] == "new":
                in_grads[g] = st.new(origin[1], ACTIVATIONS, holder)
        if not accumulate:
            st.add(GRADS, p.grad_bytes)
        out_grads = in_grads
    if not send:
        st.release(("gout", m))


def stage_key(schedule: Schedule, stage: int, cells: Sequence[Sequence[LayerProfile]]) -> tuple:
    """Stages with equal keys have equal memory (used to walk identical stages once)."""
    actions = tuple((a.kind, a.microbatch) for a in schedule.stages[stage])
    return (actions, stage == 0, tuple(tuple(id(p) for p in cell) for cell in cells))


def relabel(memory: StageMemory, stage: int) -> StageMemory:
    return dataclasses.replace(memory, stage=stage)


__all__ = ["StageMemory", "walk_stage", "walk_device", "stage_key", "relabel", "boundary_bytes",
           "boundary_grad_bytes"]
