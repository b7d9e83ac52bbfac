"""Boundary values between stage processes over torch.distributed point-to-point.

A receiver must allocate a buffer before it can receive a tensor, so it must know every shape and
dtype in advance. Sending that description with every message would double the number of messages
(and pickle on the hot path), so it is agreed ONCE per *input signature*:

- the signature of a step is the structure, shapes and dtypes (and plain values) of its micro-batch
  inputs, plus whether it trains. Every rank is given the same inputs and targets in ``train_step``
  (a torchrun script with deterministic data, or the same tensors handed to each process), so every
  rank computes the same signature without talking;
- the first step with a new signature sends, before each boundary value, a small pickled header:
  the sender's signature (so a rank that was given different inputs is caught with a clear error)
  and the value's *spec* (tuple structure, tensor shapes and dtypes, plain values). Both sides cache it;
- every later step with that signature sends the raw tensors only. The sender checks locally that
  the value still matches the agreed spec (free), and says what changed if it does not.

Tensors of an activation that share memory (``(h, h)``, ``(h, h[0])``) travel once: the spec holds
the value's :data:`~gpipe_repro.engine.aliasing.Layout`, and the receiver rebuilds the others from
the one received (:mod:`gpipe_repro.engine.aliasing`). Floating tensors come back with gradients;
integer/bool tensors and plain values travel forward only
(:mod:`gpipe_repro.engine.boundary`). Gradient lists may hold ``None`` (nothing flowed): that is part of the
spec too.

Sends are non-blocking (``isend``): the step waits for them at its end (:meth:`finish_step`), and
before each compute action for those issued before the previous one (:meth:`release_sent`), so a sent
activation is not kept alive for the rest of the step. Receives block when their action runs. On gloo,
once the specs are known, the step's receives are posted ahead of their actions (``prepost``): the
bytes then move as soon as the sender sends, while the receiver is still computing, instead of when it
reaches the RECV action (and a gloo send cannot complete before its receive is posted). At most a
window of each channel's receives is posted at once, the next one as one is used, so the buffers
waiting do not grow with M (:mod:`gpipe_repro.engine.schedule.receive_window` chooses the window).
NCCL would queue a posted receive in front of later sends on the same pair's stream, so there it
receives at the action.

Every wait has a timeout, and a failed or timed-out operation raises :class:`PeerFailure` naming the
peer rank and the message, so a dead neighbour ends this process within the timeout instead of
hanging it.
"""
from __future__ import annotations

import collections
import datetime
import functools
import pickle
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from gpipe_repro.distributed.process_group import StageContext
from gpipe_repro.distributed.watchdog import PeerFailure
from gpipe_repro.engine import aliasing, boundary
from gpipe_repro.engine.agreement import Contribution
from gpipe_repro.engine.schedule import Action, ActionKind

Spec = tuple  # ("tensor", shape, dtype) | ("seq", "tuple" | "list" | type, (Spec, ...)) | ("value", plain)
Message = tuple[Spec, "aliasing.Layout | None"]   # a value's spec, and which of its tensors travel

ACTIVATION, GRADIENT = 0, 1
_SIZE_LEAF, _HEADER_LEAF = 1022, 1023   # tag slots of the header's size and bytes
MAX_LEAVES = 1022                        # tensor leaves use tag slots 0..1021
_KIND_NAMES = {ACTIVATION: "activation", GRADIENT: "gradient"}


# -- specs ------------------------------------------------------------------------------------------
def describe(value: Any) -> Spec:
    """The spec of a boundary value (or of a micro-batch input): hashable, picklable, comparable."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return ("seq", _sequence_kind(type(value)), tuple(describe(v) for v in value))
    if isinstance(value, boundary.PLAIN):
        return ("value", value)
    raise TypeError(f"a {type(value).__name__} cannot cross between stage processes; use tensors, "
                    "tuples and plain values (None/bool/int/float/str)")


@functools.cache
def _sequence_kind(kind: type) -> str | type:
    """How a spec names a sequence type: "tuple" or "list", or the type itself (a named tuple, a
    ``torch.return_types`` value), which the receiving process rebuilds by importing it. Once per
    type: every send describes its value."""
    if kind in (tuple, list):
        return kind.__name__
    try:
        pickle.loads(pickle.dumps(kind))
    except Exception as e:  # noqa: BLE001 - any failure to send the type by reference
        raise TypeError(f"a {kind.__qualname__} cannot cross between stage processes: the next "
                        f"process rebuilds it by importing its type, and it cannot ({e}); define it at "
                        "the top level of a module, or return a plain tuple") from None
    return kind


def _leaf_specs(spec: Spec) -> list[Spec]:
    if spec[0] == "tensor":
        return [spec]
    if spec[0] == "seq":
        return [t for s in spec[2] for t in _leaf_specs(s)]
    return []


def allocate(spec: Spec, device: torch.device,
             layout: aliasing.Layout | None = None) -> list[torch.Tensor]:
    """Empty receive buffers for the tensor leaves of `spec` that travel (all of them, or those
    `layout` says travel), in leaf order."""
    return [torch.empty(s[1], dtype=s[2], device=device)
            for s in aliasing.travelling(_leaf_specs(spec), layout)]


def rebuild(spec: Spec, leaves: Iterator[torch.Tensor]) -> Any:
    """The value described by `spec`, taking its tensors from `leaves` in order."""
    if spec[0] == "tensor":
        return next(leaves)
    if spec[0] == "seq":
        items = [rebuild(s, leaves) for s in spec[2]]
        kind = spec[1]
        if kind == "tuple":
            return tuple(items)
        if kind == "list":
            return items
        return kind(*items) if hasattr(kind, "_fields") else kind(items)    # as microbatch.rebuild
    return spec[1]


def signature(microbatches: list[Any], training: bool) -> Hashable:
    """The key under which boundary specs are agreed: every rank computes it from its own inputs."""
    return (training, tuple(describe(mb) for mb in microbatches))


def _tag(kind: int, microbatch: int, leaf: int, chunk: int = 0, chunks: int = 1) -> int:
    """The message tag of one tensor leaf. `chunk` tells apart the stages one process sends from to
    the same neighbour process (interleaved 1F1B: the sending stage // K of `chunks` = v); with one
    stage per process it is 0 and the tag is the plain (micro-batch, kind, leaf) one."""
    return (((microbatch * 2 + kind) * chunks + chunk) << 10) | leaf


# -- transport --------------------------------------------------------------------------------------
class ProcessGroupTransport:
    """The :class:`~gpipe_repro.engine.stage.Transport` between stage processes (see module docstring)."""

    def __init__(self, context: StageContext, prepost: bool = True,
                 group: dist.ProcessGroup | None = None,
                 agree_group: dist.ProcessGroup | None = None, rank_offset: int = 0,
                 counts_norm: bool = True) -> None:
        self.rank, self.device, self.group = context.rank, context.device, group
        # Replicas (gpipe_repro.distributed.groups): stage s of this pipeline is rank rank_offset + s.
        self.rank_offset = rank_offset
        # At AGREE, whether this rank's squared gradient norm counts: after the data-parallel
        # all-reduce every replica of a stage holds the same gradients, so only replica 0's counts.
        self.counts_norm = counts_norm
        self.agree_group = agree_group   # a CPU (gloo) group for the AGREE all-reduce
        self.timeout = datetime.timedelta(seconds=context.timeout_s)
        self.prepost = prepost and context.backend == "gloo"
        self.specs: dict[Hashable, dict[tuple[int, int, int], Message]] = {}
        self._known: dict[tuple[int, int, int], Message] = {}
        self._learning = True
        self._waits_at_action = False
        self._key: Hashable = None
        # in-flight sends: (work, tensors kept alive, generation, destination rank)
        self._sends: list[tuple[dist.Work | None, list[torch.Tensor], int, int]] = []
        self._generation = 0
        self._posted: dict[tuple[int, int, int],
                           tuple[Message, list[torch.Tensor], list[dist.Work | None]]] = {}
        # per channel (kind, sending stage): the micro-batches whose receives are not posted yet
        self._pending: dict[tuple[int, int], collections.deque[int]] = collections.defaultdict(
            collections.deque)
        # Values between two stages on this same process (zb-v's chunks K-1 and K): handed over in
        # memory, (kind, sending stage, micro-batch) -> a copy of the value.
        self._local: dict[tuple[int, int, int], Any] = {}
        # Where each stage runs (Schedule.process_of()); None: stage s is process s. Set per step.
        self.process_of: list[int] | None = None
        self._processes, self._chunks = 1, 1
        # AGREE: the callables giving this process's stages' vectors (set by the runtime; several when
        # the process runs several stages), and the agreed sum, computed once per step.
        self.contributions: list[Callable[[], Contribution]] | None = None
        self.agreed: Contribution | None = None

    # -- step lifecycle -----------------------------------------------------------------------------
    def begin_step(self, key: Hashable, actions: Iterable[Action],
                   process_of: list[int] | None = None, window: int | None = None,
                   waits_at_action: bool = False) -> None:
        """Start a step with input signature `key`; post its receives early when specs are known:
        the first `window` of each channel (None: every one; see
        :mod:`gpipe_repro.engine.schedule.receive_window`), then one more each time one is used.
        `waits_at_action`: where receives are made at their actions (the first step of a signature,
        or ``prepost`` off), whether :meth:`release_sent` may still wait for older sends
        (:func:`~gpipe_repro.engine.schedule.receive_window.sends_waited_at_first_step`).
        `process_of[s]` is the process (within this pipeline) running stage s; default: s."""
        if self._posted or self._sends:
            raise RuntimeError("the previous step left messages in flight; call finish_step()")
        self._local.clear()           # what a failed step handed over inside this process
        self.process_of = process_of
        self._processes = 1 + max(process_of) if process_of else 1
        self._chunks = -(-len(process_of) // self._processes) if process_of else 1
        self.agreed = None
        self._key = key
        self._learning = key not in self.specs
        self._waits_at_action = waits_at_action
        self._known = self.specs.setdefault(key, {})
        self._pending.clear()
        if self.prepost and not self._learning:
            for a in actions:
                m = a.microbatch
                if a.kind is ActionKind.RECV_ACT and m is not None and not self._here(a.stage - 1):
                    self._pending[(ACTIVATION, a.stage - 1)].append(m)
                elif a.kind is ActionKind.RECV_GRAD and m is not None and not self._here(a.stage + 1):
                    self._pending[(GRADIENT, a.stage + 1)].append(m)
            for (kind, stage), waiting in self._pending.items():
                for _ in range(len(waiting) if window is None else min(window, len(waiting))):
                    self._post(kind, stage, waiting.popleft())

    def finish_step(self) -> None:
        """Wait for every send of the step (a receiver that never receives fails here, by timeout)."""
        sends, self._sends = self._sends, []
        for work, _, _, dst in sends:
            self._wait(work, f"sending to rank {dst}", dst)
        if self._posted or any(self._pending.values()):
            left = sorted(self._posted) + sorted((kind, stage, m) for (kind, stage), waiting
                                                 in self._pending.items() for m in waiting)
            self._posted.clear()
            self._pending.clear()
            raise RuntimeError(f"rank {self.rank}: receives posted but never used: {left}")
        if self._local:
            left = sorted(self._local)
            self._local.clear()
            raise RuntimeError(f"rank {self.rank}: values sent between its own stages but never "
                               f"received (kind, stage, micro-batch): {left}")

    # -- the Transport protocol ---------------------------------------------------------------------
    def rank_of(self, stage: int) -> int:
        """The global rank running `stage` of this pipeline."""
        return self.rank_offset + (stage if self.process_of is None else self.process_of[stage])

    def send_activation(self, stage: int, microbatch: int, value: Any) -> None:
        self._send(ACTIVATION, stage, stage + 1, microbatch, value)

    def recv_activation(self, stage: int, microbatch: int) -> Any:
        return boundary.attach(self._recv(ACTIVATION, stage - 1, microbatch), self.device)

    def send_gradient(self, stage: int, microbatch: int, grads: list[torch.Tensor | None]) -> None:
        self._send(GRADIENT, stage, stage - 1, microbatch, tuple(grads))

    def recv_gradient(self, stage: int, microbatch: int) -> list[torch.Tensor | None]:
        return list(self._recv(GRADIENT, stage + 1, microbatch))

    def agree(self, stage: int, contribution: Callable[[], Contribution]) -> Contribution:
        """AGREE: wait for this rank's sends, then one all-reduce (sum) of the stages' small vectors
        on the CPU control group; a rank that never arrives makes this time out (PeerFailure).
        Once per step: a process running several stages adds their vectors (:attr:`contributions`)
        into one all-reduce at its first AGREE, and its other AGREEs read the same sum."""
        if self.agreed is not None:
            return self.agreed
        sends, self._sends = self._sends, []
        for work, _, _, dst in sends:
            self._wait(work, f"sending to rank {dst}", dst)
        mine = Contribution.total(c() for c in (self.contributions or [contribution]))
        if not self.counts_norm:
            mine = mine.without_norm()
        # The control group is gloo, on the CPU: on a GPU this copy waits for the step's kernels,
        # which the step's end waits for anyway (the runtime times the step).
        vec = mine.vector.cpu()
        work = dist.all_reduce(vec, group=self.agree_group, async_op=True)
        self._wait(work, "agreeing on the step (the all-reduce before the update)", None)
        self.agreed = Contribution(vec)
        return self.agreed

    # -- internals ----------------------------------------------------------------------------------
    def _chunk(self, stage: int) -> int:
        return 0 if self.process_of is None else stage // self._processes

    def _here(self, stage: int) -> bool:
        """Whether `stage` runs on this process."""
        return self.rank_of(stage) == self.rank

    def _send(self, kind: int, stage: int, to_stage: int, microbatch: int, value: Any) -> None:
        dst = self.rank_of(to_stage)
        if dst == self.rank:          # both stages here: a copy, as a message would be
            self._local[(kind, stage, microbatch)] = aliasing.map_tensors(
                value, lambda t: t.detach().clone())
            return
        chunk, chunks = self._chunk(stage), self._chunks
        tensors = boundary.tensors(value)
        spec: Message = (describe(value), aliasing.layout(tensors, None) if kind == ACTIVATION else None)
        slot = (kind, stage, microbatch)
        if self._learning:
            self._known[slot] = spec
            header = torch.frombuffer(bytearray(pickle.dumps((self._key, spec))), dtype=torch.uint8)
            size = torch.tensor([header.numel()], dtype=torch.int64)
            for leaf, t in ((_SIZE_LEAF, size), (_HEADER_LEAF, header)):
                t = t.to(self.device)
                tag = _tag(kind, microbatch, leaf, chunk, chunks)
                work = self._start(dist.isend, t, dst, tag, "sending to")
                self._sends.append((work, [t], self._generation, dst))
        elif self._known.get(slot) != spec:
            raise RuntimeError(
                f"stage {stage}: the {_KIND_NAMES[kind]} of micro-batch {microbatch} for "
                f"stage {to_stage} is "
                f"{_show(spec)}, but it was {_show(self._known.get(slot))} when the stages agreed on "
                "boundary shapes for these input shapes. Boundary shapes, dtypes and plain values must "
                "be a function of the input shapes (the same on every step with the same inputs' "
                "shapes); return a tensor instead of a changing plain value")
        leaves = aliasing.travelling(tensors, spec[1])
        if len(leaves) > MAX_LEAVES:
            raise ValueError(f"stage {stage}: a boundary value holds {len(leaves)} "
                             f"tensors; at most {MAX_LEAVES} can cross between stages: concatenate some of "
                             "them")
        for i, t in enumerate(leaves):
            if t.numel() == 0:
                continue
            t = t.contiguous()
            work = self._start(dist.isend, t, dst, _tag(kind, microbatch, i, chunk, chunks), "sending to")
            self._sends.append((work, [t], self._generation, dst))

    def _recv(self, kind: int, stage: int, microbatch: int) -> Any:
        """Receive what `stage` sent (of `kind`, for `microbatch`)."""
        src = self.rank_of(stage)
        if src == self.rank:
            try:
                return self._local.pop((kind, stage, microbatch))
            except KeyError:
                raise RuntimeError(
                    f"rank {self.rank}: stage {stage} runs on this process too but has not sent the "
                    f"{_KIND_NAMES[kind]} of micro-batch {microbatch} yet; a process's program must "
                    "send before it receives between its own stages") from None
        what = f"the {_KIND_NAMES[kind]} of micro-batch {microbatch} from rank {src}"
        posted = self._posted.pop((kind, stage, microbatch), None)
        waiting = self._pending.get((kind, stage))
        if posted is not None and waiting:      # the channel's next receive takes this one's place
            self._post(kind, stage, waiting.popleft())
        if posted is None:
            slot = (kind, stage, microbatch)
            if self._learning:
                self._known[slot] = self._recv_header(kind, stage, microbatch, what)
            posted = self._post(kind, stage, microbatch, keep=False)
        (spec, layout), buffers, works = posted
        for work in works:
            self._wait(work, f"receiving {what}", src)
        return rebuild(spec, iter(aliasing.expand(layout, buffers)))

    def _post(self, kind: int, stage: int, microbatch: int, keep: bool = True
              ) -> tuple[Message, list[torch.Tensor], list[dist.Work | None]]:
        src, chunk, chunks = self.rank_of(stage), self._chunk(stage), self._chunks
        slot = (kind, stage, microbatch)
        if slot not in self._known:
            raise RuntimeError(f"rank {self.rank}: no agreed spec for {_KIND_NAMES[kind]} of "
                               f"micro-batch {microbatch} from rank {src}; the schedule changed "
                               "between steps with the same inputs")
        spec = self._known[slot]
        buffers = allocate(spec[0], self.device, spec[1])
        works = [self._start(dist.irecv, t, src, _tag(kind, microbatch, i, chunk, chunks), "receiving from")
                 for i, t in enumerate(buffers) if t.numel() > 0]
        posted = (spec, buffers, works)
        if keep:
            self._posted[(kind, stage, microbatch)] = posted
        return posted

    def _recv_header(self, kind: int, stage: int, microbatch: int, what: str) -> Message:
        src, chunk, chunks = self.rank_of(stage), self._chunk(stage), self._chunks
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait(self._start(dist.irecv, size, src, _tag(kind, microbatch, _SIZE_LEAF, chunk, chunks),
                               "receiving from"), f"receiving {what}", src)
        header = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._wait(self._start(dist.irecv, header, src,
                               _tag(kind, microbatch, _HEADER_LEAF, chunk, chunks), "receiving from"),
                   f"receiving {what}", src)
        key, spec = pickle.loads(header.cpu().numpy().tobytes())
        if key != self._key:
            raise RuntimeError(
                f"rank {self.rank} and rank {src} were given different inputs: every rank must call "
                "train_step/forward with the same inputs and targets (same shapes and dtypes; ranks "
                "other than the first only read their shapes). "
                f"rank {src}: {_show(key)}; rank {self.rank}: {_show(self._key)}")
        return spec

    def _start(self, op: Any, t: torch.Tensor, peer: int, tag: int, doing: str) -> dist.Work | None:
        """Post a send or receive; a peer whose connection is already gone makes gloo raise here, at
        once, rather than in :meth:`_wait`: the same PeerFailure, naming it."""
        try:
            return op(t, peer, group=self.group, tag=tag)
        except Exception as e:  # gloo: "Connection reset by peer", "pair closure", ...
            raise PeerFailure(f"rank {self.rank} lost rank {peer} while {doing} it (the connection "
                              f"is gone: it died or failed): {e}", peer) from e

    def _wait(self, work: dist.Work | None, doing: str, peer: int | None) -> None:
        if work is None:  # not a member of the group: nothing to wait for
            return
        try:
            work.wait(self.timeout)
        except Exception as e:  # gloo raises RuntimeError/DistBackendError with the socket's story
            raise PeerFailure(
                f"rank {self.rank} lost {'a rank' if peer is None else f'rank {peer}'} while {doing} "
                f"(it died, failed or did not answer "
                f"within {self.timeout.total_seconds():g} s): {e}", peer) from e

    def release_sent(self) -> None:
        """Called before each compute action: wait for sends older than the previous compute action,
        so their buffers are freed during the step rather than at its end.

        Only when this step's receives are posted ahead (the window they are posted in is one under
        which these waits cannot deadlock: :mod:`gpipe_repro.engine.schedule.receive_window`), or
        received at their actions under a schedule where these waits cannot deadlock either
        (`waits_at_action`; on gloo, whose works say they are done only when waited for).
        Otherwise (first step of a signature, NCCL) only sends already known complete are dropped."""
        self._generation += 1
        if (self.prepost and not self._learning) or (self._waits_at_action and self.device.type != "cuda"):
            for work, _, g, dst in self._sends:
                if g < self._generation - 1:
                    self._wait(work, f"sending to rank {dst}", dst)
            self._sends = [s for s in self._sends if s[2] >= self._generation - 1]
        elif self.device.type == "cuda":  # NCCL works know when they are done; gloo's only on wait
            self._sends = [s for s in self._sends if s[0] is not None and not s[0].is_completed()]


def _show(spec: Any) -> str:
    text = repr(spec)
    return text if len(text) < 300 else text[:300] + "..."
