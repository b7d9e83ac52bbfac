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
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from gpipe_repro.engine import boundary
from gpipe_repro.engine.batchnorm import DeferredBatchNorm
from gpipe_repro.engine.recompute import recomputing
from gpipe_repro.engine.rng import seed_layer, step_key
from gpipe_repro.engine.schedule import Action, ActionKind, Schedule
from gpipe_repro.engine.timeline import Event

LossFn = Callable[[Any, Any], torch.Tensor]


class Transport(Protocol):
    """How boundary values travel between stages."""

    def send_activation(self, stage: int, microbatch: int, value: Any) -> None: ...
    def recv_activation(self, stage: int, microbatch: int) -> Any: ...
    def send_gradient(self, stage: int, microbatch: int, grads: list[torch.Tensor | None]) -> None: ...
    def recv_gradient(self, stage: int, microbatch: int) -> list[torch.Tensor | None]: ...


class StageExecutor:
    """Runs one cell's share of a schedule (see the module docstring)."""

    def __init__(self, cell: nn.Sequential, stage: int, num_stages: int, first_layer: int,
                 device: torch.device, transport: Transport, loss_fn: LossFn | None = None,
                 optimizer: torch.optim.Optimizer | None = None, seed: int = 0,
                 clock: Callable[[], float] | None = None) -> None:
        self.cell, self.stage, self.num_stages = cell, stage, num_stages
        self.first_layer, self.device, self.transport = first_layer, device, transport
        self.loss_fn, self.optimizer, self.seed = loss_fn, optimizer, seed
        self.clock = clock           # set to record a timeline of executed actions
        self.events: list[Event] = []
        self.is_last = stage == num_stages - 1
        self.batchnorms = [m for m in cell.modules() if isinstance(m, DeferredBatchNorm)]
        self._reset()

    # -- step lifecycle ---------------------------------------------------------------------------
    def _reset(self) -> None:
        self.inputs: dict[int, Any] = {}
        self.graphs: dict[int, Any] = {}
        self.outbox: dict[tuple[ActionKind, int], Any] = {}
        self.grads_in: dict[int, list[torch.Tensor | None]] = {}
        self.outputs: dict[int, Any] = {}
        self.loss_sum: torch.Tensor | None = None

    def begin_step(self, step: int, schedule: Schedule, microbatches: Sequence[Any] | None = None,
                   targets: Sequence[Any] | None = None, weights: Sequence[float] | None = None) -> None:
        """Prepare for one mini-batch. Stage 0 gets the input micro-batches, the last stage the targets
        and the loss weights (n_m/N for a mean loss, 1 for a sum)."""
        self._reset()
        self.step = step
        self.step_key = step_key(self.seed, step)
        self.checkpointed = schedule.checkpointed(self.stage)
        self.training = schedule.training
        self.microbatches = list(microbatches) if microbatches is not None else None
        self.targets = list(targets) if targets is not None else None
        self.weights = list(weights) if weights is not None else None
        self.events = []
        if self.training:
            for p in self.cell.parameters():
                p.grad = None

    def end_step(self) -> float | None:
        """Check nothing is left behind; return this stage's share of the loss (last stage only)."""
        leftover = list(self.inputs) + list(self.graphs) + [k for k in self.outbox]
        if self.training and leftover:
            raise RuntimeError(f"stage {self.stage}: state left after the step for {leftover}; "
                               "the schedule is missing actions")
        return None if self.loss_sum is None else float(self.loss_sum)

    # -- actions ------------------------------------------------------------------------------------
    def execute(self, action: Action) -> None:
        start = self.clock() if self.clock else 0.0
        getattr(self, "_" + action.kind.value)(action.microbatch)
        if self.clock:
            self.events.append(Event(self.stage, action.kind.value, action.microbatch, start, self.clock()))

    def _recv_act(self, m: int) -> None:
        self.inputs[m] = self.transport.recv_activation(self.stage, m)

    def _forward(self, m: int) -> None:
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
            else:
                loss = out if keep_graph else self._loss(out, m)
                self._add_loss(loss.detach())
                if keep_graph:
                    self.graphs[m] = loss
        else:
            self.outbox[(ActionKind.SEND_ACT, m)] = boundary.detach(out)

    def _send_act(self, m: int) -> None:
        self.transport.send_activation(self.stage, m, self.outbox.pop((ActionKind.SEND_ACT, m)))

    def _recv_grad(self, m: int) -> None:
        self.grads_in[m] = self.transport.recv_gradient(self.stage, m)

    def _recompute(self, m: int) -> None:
        with torch.enable_grad(), recomputing():
            self.graphs[m] = self._run(self.inputs[m], m)

    def _backward(self, m: int) -> None:
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

    def _send_grad(self, m: int) -> None:
        self.transport.send_gradient(self.stage, m, self.outbox.pop((ActionKind.SEND_GRAD, m)))

    def _optimizer_step(self, m: None) -> None:
        for bn in self.batchnorms:
            bn.commit()
        if self.optimizer is not None:
            self.optimizer.step()

    # -- helpers ------------------------------------------------------------------------------------
    def _run(self, x: Any, m: int) -> Any:
        """The cell's forward on micro-batch m, seeding each layer; the last stage adds the loss."""
        for i, layer in enumerate(self.cell):
            seed_layer(self.seed, self.step, self.first_layer + i, m, self.device, self.step_key)
            x = layer(x)
            boundary.check(x, f"layer {self.first_layer + i} ({type(layer).__name__})")
        if self.is_last and self.training and torch.is_grad_enabled():
            return self._loss(x, m)
        return x

    def _loss(self, out: Any, m: int) -> torch.Tensor:
        if self.loss_fn is None or self.targets is None or self.weights is None:
            raise RuntimeError("the last stage needs a loss_fn, targets and loss weights to train")
        loss = self.loss_fn(out, self.targets[m])
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError("loss_fn must return a scalar tensor (0-dim); use a reducing loss")
        return loss * self.weights[m]

    def _add_loss(self, loss: torch.Tensor) -> None:
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss


def wall_clock(t0: float | None = None) -> Callable[[], float]:
    """A clock for :attr:`StageExecutor.clock`: seconds since `t0` (default: now)."""
    origin = time.perf_counter() if t0 is None else t0
    return lambda: time.perf_counter() - origin
