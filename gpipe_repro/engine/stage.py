"""The stage executor: what one pipeline stage does for each action of the schedule.

There is one executor; the runtimes differ only in the :class:`Transport` that carries values between
stages (a dict in one process, torch.distributed point-to-point between processes) and in how they
interleave stages. Per micro-batch m the executor keeps:

- ``inputs[m]``: the cell's boundary input (an autograd leaf), kept until m's backward;
- ``graphs[m]``: the output (or, on the last stage, the loss) *with* its autograd graph, present only
  between a non-checkpointed FORWARD (or a RECOMPUTE) and the BACKWARD. A checkpointed forward runs
  under ``no_grad`` and keeps nothing but the input: that is re-materialization;
- ``outbox``: detached outputs / input gradients waiting for their SEND.

Every layer runs after :func:`gpipe_repro.engine.rng.seed_layer`, so a RECOMPUTE draws the same dropout masks
as its FORWARD, and results do not depend on how the model is cut.

**In-place layers.** A cell's input is kept for its recompute and backward, and on stage 0 it is the
caller's own tensor. A cell that modifies its input in place (``ReLU(inplace=True)``,
``Dropout(inplace=True)``, ``x.mul_(2)`` right after a cut) would corrupt both, or trip autograd's
"leaf Variable ... in-place" check. So the executor learns, once per mode (training / eval), whether
the cell modifies its input: the first run feeds it a copy and compares the copy's version counters
before and after. A cell that did is always fed a copy; a cell that did not runs on its input
directly, at no cost, and the version counters are still compared after every run, so a cell that
starts modifying its input later fails the step (before any update) instead of training on corrupted
data. Stage 0's input is the caller's batch, which must never change: stage 0 always copies it.

**AGREE.** The action where every stage's gradients are final and the stages agree on one small
vector (:data:`AGREEMENT_FIELDS`), summed over stages by the transport: the loss, the loss's count
for ``(sum, count)`` losses, the squared global gradient norm and whether a gradient is not finite.
From it every stage derives the same gradient factor (1/count, 1/loss scale, the clipping
coefficient) and whether to skip the update (fp16 overflow); OPTIMIZER_STEP applies them. They live
in :mod:`gpipe_repro.engine.agreement` (re-exported here). A tied parameter's copy that another cell
counts (:mod:`gpipe_repro.engine.tied`) stays out of this stage's gradient norm (``uncounted``).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from gpipe_repro.engine import boundary
from gpipe_repro.engine.agreement import (
    AGREEMENT_FIELDS,
    PRECISIONS,
    Agreement,
    StepConfig,
    autocast,
    cast_boundary,
    upcast,
)
from gpipe_repro.engine.backward_split import (
    backward_now,
    full_backward,
    reached_params,
    split_backward_input,
)
from gpipe_repro.engine.batchnorm import DeferredBatchNorm
from gpipe_repro.engine.feeding import Feed, feed
from gpipe_repro.engine.recompute import recomputing
from gpipe_repro.engine.rng import seed_layer, step_key
from gpipe_repro.engine.schedule import Action, ActionKind, Schedule, ScheduleError
from gpipe_repro.engine.timeline import Event

__all__ = ["LossFn", "Transport", "StepConfig", "Agreement", "AGREEMENT_FIELDS", "StageExecutor",
           "wall_clock", "PRECISIONS"]

LossFn = Callable[[Any, Any], Any]


class Transport(Protocol):
    """How boundary values travel between stages, and how the stages agree at AGREE."""

    def send_activation(self, stage: int, microbatch: int, value: Any) -> None: ...
    def recv_activation(self, stage: int, microbatch: int) -> Any: ...
    def send_gradient(self, stage: int, microbatch: int, grads: list[torch.Tensor | None]) -> None: ...
    def recv_gradient(self, stage: int, microbatch: int) -> list[torch.Tensor | None]: ...
    def agree(self, stage: int, contribution: Callable[[], list[float]]) -> list[float]:
        """The sum over all stages of their AGREE vectors (`contribution()` computes this stage's)."""
        ...


class StageExecutor:
    """Runs one cell's share of a schedule (see the module docstring).

    Args:
        cell: the stage's layers.
        stage: its index, 0..num_stages-1; num_stages: K.
        first_layer: the index of the cell's first layer in the whole model (for RNG seeding).
        device: where the cell lives; transport: how values reach the other stages.
        loss_fn: the last stage's loss; optimizer: this cell's optimizer (None: no update).
        seed: the pipeline's seed (dropout masks are a function of seed, step, layer, micro-batch).
        clock: set to record a timeline of executed actions.
    """

    def __init__(self, cell: nn.Sequential, stage: int, num_stages: int, first_layer: int,
                 device: torch.device, transport: Transport, loss_fn: LossFn | None = None,
                 optimizer: torch.optim.Optimizer | None = None, seed: int = 0,
                 clock: Callable[[], float] | None = None) -> None:
        self.cell, self.stage, self.num_stages = cell, stage, num_stages
        self.first_layer, self.device, self.transport = first_layer, device, transport
        self.loss_fn, self.optimizer, self.seed = loss_fn, optimizer, seed
        self.clock = clock           # set to record a timeline of executed actions
        # Replicas: this replica's micro-batch m is micro-batch m + offset of the global mini-batch
        # (its dropout masks are that micro-batch's); set by the distributed runtime.
        self.microbatch_offset = 0
        self.events: list[Event] = []
        self.is_last = stage == num_stages - 1
        self.batchnorms = [m for m in cell.modules() if isinstance(m, DeferredBatchNorm)]
        self.config = StepConfig()
        self.agreement: Agreement | None = None
        # Whether the cell modifies its input in place, per mode (True: training); None: not known yet.
        self.copies_input: dict[bool, bool] = {}
        # The same for each layer's input at the cuts of a split backward, per (mode, layer).
        self.copies_layer_input: dict[tuple[bool, int], bool] = {}
        # Micro-batches whose backward is split (BACKWARD_INPUT / BACKWARD_WEIGHT) this step.
        self.split_microbatches: frozenset[int] = frozenset()
        self.param_order: dict[int, int] = {}
        self.uncounted: frozenset[str] = frozenset()   # tied copies another cell counts in the norm
        # One handler per action kind (DeepSpeed's _INSTRUCTION_MAP style).
        self.handlers: dict[ActionKind, Callable[[int | None], None]] = {
            ActionKind.RECV_ACT: self._recv_act, ActionKind.FORWARD: self._forward,
            ActionKind.SEND_ACT: self._send_act, ActionKind.RECV_GRAD: self._recv_grad,
            ActionKind.RECOMPUTE: self._recompute, ActionKind.BACKWARD: self._backward,
            ActionKind.SEND_GRAD: self._send_grad, ActionKind.AGREE: self._agree,
            ActionKind.OPTIMIZER_STEP: self._optimizer_step,
            ActionKind.BACKWARD_INPUT: self._backward_input,
            ActionKind.BACKWARD_WEIGHT: self._backward_weight}
        self._reset()

    # -- step lifecycle ---------------------------------------------------------------------------
    def _reset(self) -> None:
        self.inputs: dict[int, Any] = {}
        self.graphs: dict[int, Any] = {}
        self.outbox: dict[tuple[ActionKind, int], Any] = {}
        self.grads_in: dict[int, list[torch.Tensor | None]] = {}
        self.outputs: dict[int, Any] = {}
        self.weight_work: dict[int, Callable[[], None]] = {}   # BACKWARD_INPUT -> its BACKWARD_WEIGHT
        # Micro-batch m's graph cut at every layer boundary, for a split backward: per layer, its
        # input (autograd leaves) and its output (see _run and _backward_input).
        self.segments: dict[int, list[tuple[Any, Any]]] = {}
        self.loss_sum: torch.Tensor | None = None
        self.count_sum: torch.Tensor | None = None
        self.agreement = None

    def begin_step(self, step: int, schedule: Schedule, microbatches: Sequence[Any] | None = None,
                   targets: Sequence[Any] | None = None, weights: Sequence[float] | None = None,
                   config: StepConfig | None = None) -> None:
        """Prepare for one mini-batch. Stage 0 gets the input micro-batches, the last stage the targets
        and the loss weights (n_m/N for a mean loss, 1 for a sum or a ``(sum, count)`` loss).
        Statistics a failed previous step left pending (DeferredBatchNorm) are discarded."""
        self._reset()
        self.step = step
        self.step_key = step_key(self.seed, step)
        self.checkpointed = schedule.checkpointed(self.stage)
        self.split_microbatches = frozenset(a.microbatch for a in schedule.stages[self.stage]
                                            if a.kind is ActionKind.BACKWARD_INPUT
                                            and a.microbatch is not None)
        # The trainable parameters' positions, for the split's per-layer parameter lists (taken once
        # per step: walking the modules per layer and micro-batch cost more than the split saved).
        self.param_order = ({id(p): i for i, p in enumerate(self.cell.parameters()) if p.requires_grad}
                            if self.split_microbatches else {})
        self.training = schedule.training
        self.config = config or StepConfig()
        self.microbatches = list(microbatches) if microbatches is not None else None
        self.targets = list(targets) if targets is not None else None
        self.weights = list(weights) if weights is not None else None
        self.events = []
        for bn in self.batchnorms:
            bn.discard()
        if self.training:
            for p in self.cell.parameters():
                p.grad = None

    def end_step(self) -> float | None:
        """Check nothing is left behind; return the agreed mini-batch loss (training) or None."""
        leftover = (list(self.inputs) + list(self.graphs) + [k for k in self.outbox]
                    + [(ActionKind.BACKWARD_WEIGHT, m) for m in self.weight_work])
        if self.training and leftover:
            raise RuntimeError(f"stage {self.stage}: state left after the step for {leftover}; "
                               "the schedule is missing actions")
        return None if self.agreement is None else self.agreement.loss

    # -- actions ------------------------------------------------------------------------------------
    def execute(self, action: Action) -> None:
        """Run one action of this stage's schedule."""
        handler = self.handlers.get(action.kind)
        if handler is None:
            raise ScheduleError(f"stage {self.stage} does not understand action {action.kind!r} "
                                f"({action}); it knows {sorted(k.value for k in self.handlers)}")
        start = self.clock() if self.clock else 0.0
        handler(action.microbatch)
        if self.clock:
            self.events.append(Event(self.stage, action.kind.value, action.microbatch, start, self.clock()))

    def _recv_act(self, m: int | None) -> None:
        assert m is not None
        self.inputs[m] = self.transport.recv_activation(self.stage, m)

    def _forward(self, m: int | None) -> None:
        assert m is not None
        if self.stage == 0:
            if self.microbatches is None:
                raise RuntimeError("stage 0 was given no input micro-batches")
            self.inputs[m] = boundary.to_device(self.microbatches[m], self.device)
        keep_graph = self.training and m not in self.checkpointed
        with torch.set_grad_enabled(keep_graph):
            out = self._run(self.inputs[m], m)
        if not self.training:
            self.inputs.pop(m)
        if keep_graph:
            self.graphs[m] = out
        if self.is_last:
            if not self.training:
                self.outputs[m] = boundary.detach(out)
            elif not keep_graph:  # a checkpointed forward: the loss's value now, its graph at RECOMPUTE
                with self._autocast():
                    self._loss(out, m)
        else:
            self.outbox[(ActionKind.SEND_ACT, m)] = self._cast_boundary(boundary.detach(out))

    def _send_act(self, m: int | None) -> None:
        assert m is not None
        self.transport.send_activation(self.stage, m, self.outbox.pop((ActionKind.SEND_ACT, m)))

    def _recv_grad(self, m: int | None) -> None:
        assert m is not None
        self.grads_in[m] = self.transport.recv_gradient(self.stage, m)

    def _recompute(self, m: int | None) -> None:
        assert m is not None
        with torch.enable_grad(), recomputing():
            self.graphs[m] = self._run(self.inputs[m], m, recompute=True)

    def _backward(self, m: int | None) -> None:
        assert m is not None
        if m in self.segments:        # a graph cut for the split: both halves, now
            self._backward_input(m)
            self._backward_weight(m)
            return
        out = self.graphs.pop(m)
        if self.is_last:
            if out.requires_grad:
                torch.autograd.backward(out)
        else:
            outs, grads = boundary.grad_pairs(out, self.grads_in.pop(m))
            if outs:
                torch.autograd.backward(outs, grads)
        x = self.inputs.pop(m)
        if self.stage > 0:
            self.outbox[(ActionKind.SEND_GRAD, m)] = boundary.input_grads(x)

    def _backward_input(self, m: int | None) -> None:
        """The zero-bubble split's first half (Qi et al., ICLR 2024): only the gradient of the cell's
        input, which the previous stage waits for. The parameters' gradients are left to
        :meth:`_backward_weight`: while walking the graph back to the input we keep the gradient
        arriving at each node where a parameter's gradient path joins it (PyTorch pipelining's
        ``stage_backward_input`` / ``get_param_groups`` do the same), so the weight half starts from
        there and walks only the parameters' branches. A stage with no floating input that needs a
        gradient (stage 0, or only integer inputs) has nothing to send: its whole backward runs
        at W, as PyTorch's stage 0 does.

        The split runs one layer at a time, last to first, on the graph :meth:`_run` cut at every
        layer boundary: each layer's input gradient seeds the previous layer's split. Why: the weight
        half makes one autograd call per group of parameters, and each call walks the whole graph
        below its starting nodes, so on one graph of the cell the weight half grows with the square
        of the cell's size (a 25-layer Transformer cell at 4 rows: 63 ms against 19 ms for its
        layers split one by one); cut per layer, it is the sum of its layers' costs, which is what
        the calibration times."""
        assert m is not None
        out = self.graphs.pop(m)
        if self.is_last:
            outs, grads = ([out], [torch.ones_like(out)]) if out.requires_grad else ([], [])
        else:
            outs, grads = boundary.grad_pairs(out, self.grads_in.pop(m))
        x = self.inputs.pop(m)
        pieces = self.segments.pop(m, None)
        cells: list[tuple[Any, nn.Module]] = ([(inp, self.cell[k]) for k, (inp, _) in enumerate(pieces)]
                                             if pieces is not None else [(x, self.cell)])
        works: list[Callable[[], None]] = []
        for k in range(len(cells) - 1, -1, -1):
            if not outs:
                break                 # no gradient reaches this layer or any below it
            inp, module = cells[k]
            # stage 0's input is the model's: no stage waits for its gradient, and where it takes
            # one (a caller's x.requires_grad_()) the whole backward reaches it at W, as plain
            # training's does
            leaves = ([] if k == 0 and self.stage == 0 else
                      [t for t in boundary.tensors(inp) if boundary.carries_grad(t) and t.requires_grad])
            if not leaves:
                works.append(full_backward(outs, grads))
                break
            reached = reached_params(outs, self.param_order, leaves)
            if all(id(p) in self.param_order for p in reached):
                works.append(split_backward_input(outs, grads, leaves, reached))
            else:     # a leaf outside the cell (another cell's weight a loss reads): whole, now
                works.append(backward_now(outs, grads))
            if k > 0:                 # the cut's gradient seeds the layer below
                assert pieces is not None
                outs, grads = boundary.grad_pairs(pieces[k - 1][1], boundary.input_grads(inp))
                for t in leaves:
                    t.grad = None

        def weights() -> None:
            for work in works:
                work()
        self.weight_work[m] = weights
        if self.stage > 0:
            self.outbox[(ActionKind.SEND_GRAD, m)] = boundary.input_grads(x)

    def _backward_weight(self, m: int | None) -> None:
        """The zero-bubble split's second half: micro-batch m's parameter gradients, into ``p.grad``."""
        assert m is not None
        self.weight_work.pop(m)()

    def _send_grad(self, m: int | None) -> None:
        assert m is not None
        self.transport.send_gradient(self.stage, m, self.outbox.pop((ActionKind.SEND_GRAD, m)))

    def _agree(self, m: int | None) -> None:
        """Every stage's gradients are final: contribute this stage's numbers, get everyone's sum."""
        self.agreement = Agreement.from_sum(self.transport.agree(self.stage, self.contribution),
                                            self.config)

    def contribution(self) -> list[float]:
        """This stage's :data:`AGREEMENT_FIELDS` vector: its loss and count (last stage), its squared
        gradient norm and non-finite flag (when clipping or fp16 need them)."""
        vec = [0.0] * len(AGREEMENT_FIELDS)
        if self.is_last:
            vec[0] = 0.0 if self.loss_sum is None else _value(self.loss_sum)
            if self.count_sum is not None:
                vec[1], vec[2] = _value(self.count_sum), 1.0
        if self.config.needs_norm:
            grads = [p.grad for n, p in self.cell.named_parameters()
                     if p.grad is not None and n not in self.uncounted]
            if grads:
                norms = torch._foreach_norm(grads)
                vec[3] = _value(torch.stack([n.double() for n in norms]).square().sum())
                vec[4] = float(not math.isfinite(vec[3]))
        return vec

    def _optimizer_step(self, m: int | None) -> None:
        if self.agreement is None:
            raise ScheduleError(f"stage {self.stage}: optimizer step without an AGREE before it")
        for bn in self.batchnorms:
            bn.commit()
        if self.agreement.skip:
            return
        grads = [p.grad for p in self.cell.parameters() if p.grad is not None]
        if grads and self.agreement.factor != 1.0:
            torch._foreach_mul_(grads, self.agreement.factor)
        if self.optimizer is not None:
            self.optimizer.step()

    # -- helpers ------------------------------------------------------------------------------------
    def _run(self, x: Any, m: int, recompute: bool = False) -> Any:
        """The cell's forward on micro-batch m, seeding each layer; the last stage adds the loss.
        Feeds the cell a copy of `x` when it modifies its input in place (see the module docstring).
        Where m's backward is split (:meth:`_backward_input`), the graph is cut at every layer
        boundary (:func:`_cut`) and the pieces are kept in ``segments[m]``; each cut is fed to its
        layer by the same rule as the cell's input."""
        entry = self._feed(x, 0)
        cut: Feed | None = None          # the cut fed to the layer running now, if any
        segments: list[tuple[Any, Any]] | None = [] if self._segmented(x, m) else None
        piece_input = x
        try:
            with self._autocast():
                h = entry.value
                for i, layer in enumerate(self.cell):
                    if segments is not None and i > 0:
                        segments.append((piece_input, h))
                        piece_input = _cut(h)
                        cut = self._feed(piece_input, i)
                        h = cut.value
                    seed_layer(self.seed, self.step, self.first_layer + i, m + self.microbatch_offset,
                               self.device, self.step_key)
                    h = layer(h)
                    boundary.check(h, f"layer {self.first_layer + i} ({type(layer).__name__})")
                    if cut is not None:
                        self._settle(cut, m)
                        cut = None
                if self.is_last and self.training and torch.is_grad_enabled():
                    h = self._loss(h, m, recompute)
        except RuntimeError as e:
            fed = cut or entry                # a cut's layer raised, or else the cell did
            if "leaf Variable that requires grad" in str(e) and fed.copy is False:
                self._learned_late(m, e, fed.layer)
            raise
        self._settle(entry, m)
        if segments is not None:
            segments.append((piece_input, h))
            self.segments[m] = segments
        return h

    def _feed(self, value: Any, layer: int) -> Feed:
        """What layer `layer` (0: the cell) is fed for `value` (:func:`feeding.feed`): a copy while
        it is not known not to modify its input in place, else a view."""
        return feed(value, self._copies(layer), layer)

    def _settle(self, fed: Feed, m: int) -> None:
        """After `fed` was used: learn whether its layer modifies its input in place (first run), or
        fail the step if one fed without a copy just did."""
        modified = fed.modified()
        if fed.copy is None:
            self._learn_copies(fed.layer, modified)
        elif fed.copy is False and modified:
            self._learned_late(m, None, fed.layer)

    def _copies(self, layer: int) -> bool | None:
        """Whether layer `layer`'s input is copied in this mode (0: the cell's input); None: not known."""
        if layer == 0:
            # stage 0's input is the caller's batch: a cell that starts modifying it late would
            # already have changed the caller's tensors when caught, so stage 0 always copies
            # (one copy of the input per micro-batch, small next to the cell's activations)
            return True if self.stage == 0 else self.copies_input.get(self.training)
        return self.copies_layer_input.get((self.training, layer))

    def _learn_copies(self, layer: int, copies: bool) -> None:
        if layer == 0:
            self.copies_input[self.training] = copies
        else:
            self.copies_layer_input[(self.training, layer)] = copies

    def _segmented(self, x: Any, m: int) -> bool:
        """Whether micro-batch m's graph is cut at every layer boundary: its backward is split
        (BACKWARD_INPUT), the graph is being recorded, and the cell has an input gradient to split
        off (a stage 0, whose input is the model's, or a cell with only integer inputs, runs its
        whole backward at W)."""
        return (self.training and torch.is_grad_enabled() and m in self.split_microbatches
                and len(self.cell) > 1 and self.stage > 0
                and any(boundary.carries_grad(t) and t.requires_grad for t in boundary.tensors(x)))

    def _learned_late(self, m: int, cause: Exception | None, layer: int) -> None:
        self._learn_copies(layer, True)
        if layer == 0:
            what = (f"stage {self.stage} (layers {self.first_layer}.."
                    f"{self.first_layer + len(self.cell) - 1}) modified its input")
        else:
            what = (f"stage {self.stage}: layer {self.first_layer + layer} modified its input (a cut "
                    "of the zero-bubble split's graph)")
        raise RuntimeError(
            f"{what} in place on micro-batch {m}, which it had not done on its first run, "
            "so the kept input is corrupted; no cell was updated. The engine copies this "
            f"{'cell' if layer == 0 else 'layer'}'s input from now on: run the step again") from cause

    def _autocast(self) -> Any:
        return autocast(self.config.precision, self.device)

    def _loss(self, out: Any, m: int, recompute: bool = False) -> torch.Tensor:
        """Micro-batch m's loss, weighted for the backward; adds its value (and count) to the step's.
        A loss may return a 0-dim tensor or ``(sum, count)`` (see
        :class:`~gpipe_repro.engine.gpipe.GPipe`)."""
        if self.loss_fn is None or self.targets is None or self.weights is None:
            raise RuntimeError("the last stage needs a loss_fn, targets and loss weights to train")
        # Targets go where the last cell is (the caller may keep them on the CPU); never in place.
        result = self.loss_fn(out, boundary.to_device(self.targets[m], self.device))
        count = None
        if isinstance(result, tuple):
            if len(result) != 2:
                raise TypeError(f"loss_fn returned a tuple of {len(result)}; return a scalar tensor or "
                                "(sum, count): the micro-batch's summed loss and what it counts "
                                "(e.g. its non-padding tokens)")
            result, count = result
        if not isinstance(result, torch.Tensor) or result.dim() != 0:
            raise TypeError("loss_fn must return a scalar tensor (0-dim) or (sum, count); use a "
                            "reducing loss")
        loss = upcast(result) * (1.0 if count is not None else self.weights[m])
        if not recompute:  # the recompute's loss is the forward's again: count it once
            value = loss.detach()
            self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
            if count is not None:
                c = torch.as_tensor(count, dtype=torch.float64).detach()
                self.count_sum = c if self.count_sum is None else self.count_sum + c
        if self.config.precision == "fp16":
            loss = loss * self.config.loss_scale
        return loss

    def _cast_boundary(self, value: Any) -> Any:   # bf16/fp16: floating values cross in that dtype
        return cast_boundary(value, self.config.precision)


def _value(t: torch.Tensor) -> float:
    """A 0-dim tensor's value; NaN without data (fake or meta tensors: the memory planner's)."""
    if t.device.type == "meta" or is_fake(t):
        return math.nan
    return float(t)


def _cut(h: Any) -> Any:
    """The graph cut after a layer (:func:`boundary.cut`): its output as new autograd leaves (same
    storage, no copy), one per shared memory."""
    return boundary.cut(h)


def wall_clock(t0: float | None = None) -> Callable[[], float]:
    """A clock for :attr:`StageExecutor.clock`: seconds since `t0` (default: now)."""
    origin = time.perf_counter() if t0 is None else t0
    return lambda: time.perf_counter() - origin
