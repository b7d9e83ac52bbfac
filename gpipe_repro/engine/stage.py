"""The stage executor: what one pipeline stage does for each action of the schedule.

There is one executor; the runtimes differ only in the :class:`Transport` that carries values between
stages (a dict in one process, torch.distributed point-to-point between processes) and in how they
interleave stages (:mod:`gpipe_repro.engine.runtime`). The executor dispatches each action to its
handler and keeps, per micro-batch m:

- ``inputs[m]``: the cell's boundary input (an autograd leaf), kept until m's backward;
- ``graphs[m]``: the output (or, on the last stage, the loss) *with* its autograd graph, present only
  between a non-checkpointed FORWARD (or a RECOMPUTE) and the BACKWARD. A checkpointed forward runs
  under ``no_grad`` and keeps nothing but the input: that is re-materialization;
- ``outbox``: detached outputs / input gradients waiting for their SEND;
- ``deferred[m]`` and ``weight_work[m]``: a zero-bubble split's weight gradients deferred in m's
  forward, and its pending weight half (:mod:`gpipe_repro.engine.backward_split`).

Every layer runs after :func:`gpipe_repro.engine.rng.seed_layer`, so a RECOMPUTE draws the same dropout
masks as its FORWARD, and results do not depend on how the model is cut. What a layer is fed follows
the in-place rule of :class:`~gpipe_repro.engine.feeding.InputGuard`; the last stage's loss is
:func:`~gpipe_repro.engine.losses.weighted_loss`'s.

**AGREE** is the action where every stage's gradients are final: the stage contributes its numbers
(:func:`~gpipe_repro.engine.agreement.stage_contribution`), the transport returns their sum over
stages, and every stage derives the same :class:`~gpipe_repro.engine.agreement.Agreement` (gradient
factor, skip); OPTIMIZER_STEP applies it. A tied parameter's copy that another cell counts
(:mod:`gpipe_repro.engine.tied`) stays out of this stage's gradient norm (``uncounted``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from gpipe_repro.engine import boundary
from gpipe_repro.engine.agreement import Agreement, Contribution, StepConfig, stage_contribution
from gpipe_repro.engine.aliasing import AliasingError
from gpipe_repro.engine.backward_split import DeferredWeights, WeightWork, full_backward, splits_input
from gpipe_repro.engine.batchnorm import DeferredBatchNorm, commit_many, is_one_value_per_channel
from gpipe_repro.engine.compiled import compiled_runner
from gpipe_repro.engine.feeding import InputGuard
from gpipe_repro.engine.foreign import ForeignState
from gpipe_repro.engine.layer_state import BatchDependentFrequencies, BufferWatch
from gpipe_repro.engine.losses import weighted_loss
from gpipe_repro.engine.precision import autocast, cast_boundary
from gpipe_repro.engine.recompute import recomputing
from gpipe_repro.engine.rng import PrivateGenerators, seed_layer, step_key
from gpipe_repro.engine.schedule import Action, ActionKind, Schedule, ScheduleError
from gpipe_repro.engine.timeline import Event

__all__ = ["LossFn", "Transport", "StageExecutor"]

LossFn = Callable[[Any, Any], Any]


class Transport(Protocol):
    """How boundary values travel between stages, and how the stages agree at AGREE."""

    def send_activation(self, stage: int, microbatch: int, value: Any) -> None: ...
    def recv_activation(self, stage: int, microbatch: int) -> Any: ...
    def send_gradient(self, stage: int, microbatch: int, grads: list[torch.Tensor | None]) -> None: ...
    def recv_gradient(self, stage: int, microbatch: int) -> list[torch.Tensor | None]: ...
    def agree(self, stage: int, contribution: Callable[[], Contribution]) -> Contribution:
        """The sum over all stages of their contributions (`contribution()` computes this stage's)."""
        ...


class StageExecutor:
    """Runs one cell's share of a schedule (see the module docstring).

    Args:
        cell: the stage's layers.
        stage: its index, 0..num_stages-1; num_stages: K.
        first_layer: the index of the cell's first layer in the whole model (for RNG seeding).
        device: where the cell lives; transport: how values reach the other stages (None: the
            runtime that runs the executor gives it one, :meth:`use_transport`).
        loss_fn: the last stage's loss; optimizer: this cell's optimizer (None: no update).
        seed: the pipeline's seed (dropout masks are a function of seed, step, layer, micro-batch).
        uncounted: names of the cell's parameters left out of its gradient norm (tied copies another
            cell counts).
        tied: names of the cell's copies of parameters tied across cells, whose version counters
            :attr:`tied_versions` holds as a step begins (the local runtime compares the copies at
            AGREE where one moved: :func:`~gpipe_repro.engine.tied.refuse_copies_diverged_in_step`).
        compile_options: ``torch.compile``'s arguments: each layer runs compiled with them (the
            cell's modules themselves are not changed); None: eager.
    """

    def __init__(self, cell: nn.Sequential, stage: int, num_stages: int, first_layer: int,
                 device: torch.device, transport: Transport | None, loss_fn: LossFn | None = None,
                 optimizer: torch.optim.Optimizer | None = None, seed: int = 0, *,
                 uncounted: Collection[str] = (), tied: Collection[str] = (),
                 compile_options: Mapping[str, Any] | None = None) -> None:
        self.cell, self.stage, self.num_stages = cell, stage, num_stages
        self.first_layer, self.device, self._transport = first_layer, device, transport
        self.loss_fn, self.optimizer, self.seed = loss_fn, optimizer, seed
        self.clock: Callable[[], float] | None = None   # this step's, when it is recorded
        self.uncounted = frozenset(uncounted)
        self.tied = frozenset(tied)
        self.tied_versions: dict[str, int] = {}    # the tied copies' version counters as a step began
        # what runs each layer: the layer, or its compiled runner (engine.compiled)
        self.compile_options = compile_options
        self.runners: list[Callable[[Any], Any]] = self._runners()
        # Replicas: this replica's micro-batch m is micro-batch m + offset of the global mini-batch
        # (its dropout masks are that micro-batch's); given per step by the distributed runtime.
        self.microbatch_offset = 0
        self.events: list[Event] = []
        self.is_last = stage == num_stages - 1
        self.batchnorms = [m for m in cell.modules() if isinstance(m, DeferredBatchNorm)]
        self.config = StepConfig()
        self.agreement: Agreement | None = None
        self.input_guard = InputGuard(stage, first_layer, len(cell))
        self.buffer_watch = BufferWatch(cell, first_layer)   # layers whose forward changes their state
        self.frequencies = BatchDependentFrequencies(cell, first_layer)   # dynamic / longrope rotary
        self.generators = PrivateGenerators(list(cell))      # layers drawing from a generator of their own
        # runtime="distributed": the layers other processes hold, which this step must not reach
        self.foreign: ForeignState | None = None
        # Micro-batches whose backward is split (BACKWARD_INPUT / BACKWARD_WEIGHT) this step.
        self.split_microbatches: frozenset[int] = frozenset()
        self.checkpointed: frozenset[int] = frozenset()
        self._schedule: Schedule | None = None   # the schedule the two sets above were read from
        self.deferral: DeferredWeights | None = None   # the cell's layers whose weight gradients defer
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

    # -- what the runtimes change between steps ---------------------------------------------------
    @property
    def transport(self) -> Transport:
        if self._transport is None:
            raise RuntimeError(f"stage {self.stage}'s executor has no transport: the runtime that runs "
                               "it gives it one (use_transport)")
        return self._transport

    def use_transport(self, transport: Transport) -> None:
        """Carry boundary values and the agreement through `transport` from now on."""
        self._transport = transport

    def move_to(self, device: torch.device) -> None:
        """The cell was moved to `device` (``GPipe.to``): inputs and targets go there from now on."""
        self.device = device

    def reseed(self, seed: int) -> None:
        """Draw dropout masks from `seed` from now on (a resumed run's saved seed)."""
        self.seed = seed

    # -- step lifecycle ---------------------------------------------------------------------------
    def _runners(self) -> list[Callable[[Any], Any]]:
        options = self.compile_options
        if options is None:
            return list(self.cell)
        return [compiled_runner(layer, options) for layer in self.cell]

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy(pipe)``, ``torch.save(pipe)``) compiles its own cell's layers: a
        compiled runner closes over the layer it was made for, and a deep copy of the pipeline that
        kept it ran, and trained, the original's layers (silently: the copy's weights never moved)."""
        state = dict(self.__dict__)
        state.pop("runners", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.runners = self._runners()

    def _reset(self) -> None:
        self.inputs: dict[int, Any] = {}
        self.graphs: dict[int, Any] = {}
        self.outbox: dict[tuple[ActionKind, int], Any] = {}
        self.grads_in: dict[int, list[torch.Tensor | None]] = {}
        self.outputs: dict[int, Any] = {}
        self.weight_work: dict[int, Callable[[], None]] = {}   # BACKWARD_INPUT -> its BACKWARD_WEIGHT
        # Micro-batch m's deferred weight gradients, for a split backward.
        self.deferred: dict[int, WeightWork] = {}
        self.loss_sum: torch.Tensor | None = None
        self.count_sum: torch.Tensor | None = None
        self.agreement = None
        self.generators.clear()

    def begin_step(self, step: int, schedule: Schedule, microbatches: Sequence[Any] | None = None,
                   targets: Sequence[Any] | None = None,
                   weights: Sequence[float | torch.Tensor] | None = None,
                   config: StepConfig | None = None, *, clock: Callable[[], float] | None = None,
                   microbatch_offset: int = 0) -> None:
        """Prepare for one mini-batch. Stage 0 gets the input micro-batches, the last stage the targets
        and the loss weights (n_m/N for a mean loss, 1 for a sum or a ``(sum, count)`` loss).
        `clock`: record this step's actions (:attr:`events`) on it (None: do not record);
        `microbatch_offset`: this replica's first micro-batch in the global mini-batch.
        Statistics a failed previous step left pending (DeferredBatchNorm) are discarded."""
        self._reset()
        self.step = step
        self.step_key = step_key(self.seed, step)
        self.clock = clock
        self.microbatch_offset = microbatch_offset
        if schedule is not self._schedule:   # what this stage reads from the schedule, once per schedule
            self.checkpointed = schedule.checkpointed(self.stage)
            self.split_microbatches = frozenset(a.microbatch for a in schedule.stages[self.stage]
                                                if a.kind is ActionKind.BACKWARD_INPUT
                                                and a.microbatch is not None)
            self._schedule = schedule
        # The layers the split may defer (found once per step, not per micro-batch).
        self.deferral = DeferredWeights(self.cell) if self.split_microbatches else None
        self.training = schedule.training
        self.config = config or StepConfig()
        self.microbatches = list(microbatches) if microbatches is not None else None
        self.targets = list(targets) if targets is not None else None
        self.weights = list(weights) if weights is not None else None
        self.events = []
        self.tied_versions = {n: self.cell.get_parameter(n)._version for n in self.tied}
        if self.training:
            self.buffer_watch.begin_step(schedule.num_microbatches, bool(self.checkpointed))
        self.frequencies.begin()
        for bn in self.batchnorms:
            bn.discard()
        if self.training:
            for p in self.cell.parameters():
                p.grad = None
            if self.foreign is not None:
                self.foreign.begin_step()

    def end_step(self) -> None:
        """Check nothing is left behind (the agreement stays in :attr:`agreement`)."""
        leftover = (list(self.inputs) + list(self.graphs) + [k for k in self.outbox]
                    + [(ActionKind.BACKWARD_WEIGHT, m) for m in self.weight_work])
        if self.training and leftover:
            raise RuntimeError(f"stage {self.stage}: state left after the step for {leftover}; "
                               "the schedule is missing actions")

    # -- actions ------------------------------------------------------------------------------------
    def execute(self, action: Action) -> None:
        """Run one action of this stage's schedule."""
        handler = self.handlers.get(action.kind)
        if handler is None:
            raise ScheduleError(f"stage {self.stage} does not understand action {action.kind!r} "
                                f"({action}); it knows {sorted(k.value for k in self.handlers)}")
        start = self.clock() if self.clock else 0.0
        try:
            handler(action.microbatch)
        except RuntimeError as e:
            if "backward through the graph a second time" not in str(e):
                raise
            raise RuntimeError(
                f"stage {self.stage}, {action.kind.value} of micro-batch {action.microbatch}: autograd "
                "reached a graph already freed. A value kept from an earlier forward (a tensor a "
                "layer stores on a module attribute or a global, read by another layer or by a later "
                "micro-batch) crosses outside the pipeline's boundaries: pass it to the layers that "
                "need it through the layers' outputs (a tuple)") from e
        if self.clock:
            self.events.append(Event(self.stage, action.kind.value, action.microbatch, start, self.clock()))

    def record_event(self, kind: str, start: float) -> None:
        """Add a runtime's own activity of this step (``"allreduce"``, say), from `start` to now on
        the step's clock, to the recorded :attr:`events`; nothing when the step is not recorded."""
        if self.clock is not None:
            self.events.append(Event(self.stage, kind, None, start, self.clock()))

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
        assert self._schedule is not None
        m_count = self._schedule.num_microbatches
        before = self.buffer_watch.before_forward(m_count) if self.training else None
        with torch.set_grad_enabled(keep_graph):
            out = self._run(self.inputs[m], m)
        if before is not None:
            self.buffer_watch.after(before, "forward", m_count)
        self.frequencies.after_forward(m, m_count)
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
            try:
                sent = boundary.detach(out)
            except AliasingError as e:
                named = list(self.cell.named_children())
                last = f" (its last layer {named[-1][0]!r}, {type(named[-1][1]).__name__})" if named else ""
                raise AliasingError(f"the output of cell {self.stage}{last}, sent to cell "
                                    f"{self.stage + 1}: {e}") from None
            self.outbox[(ActionKind.SEND_ACT, m)] = cast_boundary(
                sent, self.config.precision, self.config.low_precision_boundaries)

    def _send_act(self, m: int | None) -> None:
        assert m is not None
        self.transport.send_activation(self.stage, m, self.outbox.pop((ActionKind.SEND_ACT, m)))

    def _recv_grad(self, m: int | None) -> None:
        assert m is not None
        self.grads_in[m] = self.transport.recv_gradient(self.stage, m)

    def _recompute(self, m: int | None) -> None:
        assert m is not None
        before = self.buffer_watch.before_recompute()
        with torch.enable_grad(), recomputing():
            self.graphs[m] = self._run(self.inputs[m], m, recompute=True)
        if before is not None:
            assert self._schedule is not None
            self.buffer_watch.after(before, "recompute", self._schedule.num_microbatches)

    def _backward(self, m: int | None) -> None:
        assert m is not None
        if m in self.deferred:    # a forward that deferred weight gradients: both halves, now
            self._backward_input(m)
            self._backward_weight(m)
            return
        if self.is_last:     # the loss: autograd seeds it with 1 itself, as loss.backward() does
            loss = self.graphs.pop(m)
            if loss.requires_grad:
                loss.backward()
        else:
            outs, grads = self._seeds(m)
            if outs:
                torch.autograd.backward(outs, grads)
        x = self.inputs.pop(m)
        if self.stage > 0:
            self.outbox[(ActionKind.SEND_GRAD, m)] = boundary.input_grads(x)

    def _backward_input(self, m: int | None) -> None:
        """The zero-bubble split's first half (Qi et al., ICLR 2024): the cell's backward as plain
        autograd runs it, which the forward left without the deferred layers' weight gradients
        (:mod:`~gpipe_repro.engine.backward_split`); those are left to :meth:`_backward_weight`. A
        forward that deferred nothing (stage 0, whose input is the model's; a cell whose input takes
        no gradient) runs its whole backward at W: no stage waits for its input's gradient."""
        assert m is not None
        outs, grads = self._seeds(m)
        x = self.inputs.pop(m)
        work = self.deferred.pop(m, None)
        if work is None:
            self.weight_work[m] = full_backward(outs, grads)
        else:
            if outs:
                torch.autograd.backward(outs, grads)
            self.weight_work[m] = work
        if self.stage > 0:
            self.outbox[(ActionKind.SEND_GRAD, m)] = boundary.input_grads(x)

    def _backward_weight(self, m: int | None) -> None:
        """The zero-bubble split's second half: micro-batch m's parameter gradients, into ``p.grad``."""
        assert m is not None
        self.weight_work.pop(m)()

    def _seeds(self, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Micro-batch m's backward starts: its kept graph's outputs and their incoming gradients (the
        loss and 1 on the last stage)."""
        out = self.graphs.pop(m)
        if self.is_last:
            return ([out], [torch.ones_like(out)]) if out.requires_grad else ([], [])
        return boundary.grad_pairs(out, self.grads_in.pop(m))

    def _send_grad(self, m: int | None) -> None:
        assert m is not None
        self.transport.send_gradient(self.stage, m, self.outbox.pop((ActionKind.SEND_GRAD, m)))

    def _agree(self, m: int | None) -> None:
        """Every stage's gradients are final: contribute this stage's numbers, get everyone's sum."""
        if self.foreign is not None:
            self.foreign.check()
        self.agreement = self.transport.agree(self.stage, self.contribution).agreement(self.config)

    def contribution(self) -> Contribution:
        """This stage's share of AGREE: its loss and count (last stage), its squared gradient norm and
        non-finite flag (when clipping or fp16 need them)."""
        grads = None
        if self.config.needs_norm:
            grads = [p.grad for n, p in self.cell.named_parameters()
                     if p.grad is not None and n not in self.uncounted]
        return stage_contribution(self.device, self.loss_sum if self.is_last else None,
                                  self.count_sum if self.is_last else None, grads)

    def _optimizer_step(self, m: int | None) -> None:
        if self.deferral is not None:
            self.deferral.release()       # no cast copy of a weight outlives its step
        if self.agreement is None:
            raise ScheduleError(f"stage {self.stage}: optimizer step without an AGREE before it")
        commit_many(self.batchnorms)
        if self.agreement.skipped():      # a host read, under fp16 only
            return
        if self.agreement.factor is not None:   # a tensor: no host read
            grads = [p.grad for p in self.cell.parameters() if p.grad is not None]
            factor = self.agreement.factor_on(grads[0].device) if grads else None
            if factor is not None:
                torch._foreach_mul_(grads, factor)
        if self.optimizer is not None:
            self.optimizer.step()

    # -- helpers ------------------------------------------------------------------------------------
    def _run(self, x: Any, m: int, recompute: bool = False) -> Any:
        """The cell's forward on micro-batch m, seeding each layer; the last stage adds the loss.
        The cell is fed `x` by the input guard's rule. Where m's backward is split
        (:meth:`_backward_input`), the deferrable layers defer their weight gradients into
        ``deferred[m]`` (:class:`~gpipe_repro.engine.backward_split.DeferredWeights`)."""
        guard, training = self.input_guard, self.training
        entry = guard.feed(x, training)
        deferring = (self.deferral.recording() if self.deferral is not None and training
                     and torch.is_grad_enabled() and m in self.split_microbatches
                     and splits_input(x, self.stage) else None)
        seed, step, key, device, first = self.seed, self.step, self.step_key, self.device, self.first_layer
        mb = m + self.microbatch_offset
        private = self.generators.of if training else {}
        record = m in self.checkpointed and not recompute
        try:
            with self._autocast(), deferring or contextlib.nullcontext() as work:
                h = entry.value
                for i, layer in enumerate(self.cell):
                    seed_layer(seed, step, first + i, mb, device, key)
                    if private and i in private:
                        with self.generators.around(i, m, record=record, recompute=recompute):
                            h = self.runners[i](h)
                    else:
                        h = self.runners[i](h)
                    if not isinstance(h, torch.Tensor):   # a tensor always may cross
                        boundary.check(h, f"layer {first + i} ({type(layer).__name__})")
            if self.is_last and training and torch.is_grad_enabled():
                with self._autocast():
                    h = self._loss(h, m, recompute)
        except RuntimeError as e:
            guard.caught_by_autograd(entry, training, m, e)
            raise
        except ValueError as e:
            if not is_one_value_per_channel(e):
                raise
            rows = [t.shape[0] for t in boundary.tensors(entry.value) if t.dim() > 0][:1]
            raise ValueError(
                f"layer {first + i} ({type(self.cell[i]).__name__.replace('Deferred', '')}) of cell "
                f"{self.stage} got micro-batch "
                f"{m} of {rows[0] if rows else 'so few'} row(s): normalizing by the batch's statistics "
                "needs more than one value per channel in training, and micro-batches of one row "
                "have one. Use fewer micro-batches or a larger batch: M at most half the batch, and "
                "with R data-parallel replicas R x M at most half the global batch") from e
        guard.settle(entry, training, m)
        if work is not None:
            self.deferred[m] = work
        return h

    def _autocast(self) -> Any:
        return autocast(self.config.precision, self.device)

    def _loss(self, out: Any, m: int, recompute: bool = False) -> torch.Tensor:
        """Micro-batch m's loss, weighted for the backward (:func:`weighted_loss`; scaled under fp16);
        adds its value (and count) to the step's, once per micro-batch (not again at RECOMPUTE)."""
        if self.loss_fn is None or self.targets is None or self.weights is None:
            raise RuntimeError("the last stage needs a loss_fn, targets and loss weights to train")
        # Targets go where the last cell is (the caller may keep them on the CPU); never in place.
        result = self.loss_fn(out, boundary.to_device(self.targets[m], self.device))
        loss, count = weighted_loss(result, self.weights[m])
        if not recompute:  # the recompute's loss is the forward's again: count it once
            value = loss.detach()
            self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
            if count is not None:
                self.count_sum = count if self.count_sum is None else self.count_sum + count
        if self.config.precision == "fp16":
            loss = loss * self.config.backward_scale(count is not None)
        return loss
