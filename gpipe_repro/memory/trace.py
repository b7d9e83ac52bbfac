"""Measure one training step of the real engine, per device, on real or fake tensors.

:func:`trace_step` builds a :class:`~gpipe_repro.engine.gpipe.GPipe`, runs ``train_step`` under a
:class:`~gpipe_repro.memory.tracker.MemoryTracker`, and charges every allocation to the stage whose
action made it. It is the reference the planner is checked against: the code that runs is the
engine's own (the schedule's actions executed by ``StageExecutor`` through ``run_local``). What this
module adds, without editing the engine, is instance-level instrumentation:

- each executor's ``execute`` is wrapped to open a tracker scope (stage, category) and to close a
  timeline segment per action;
- the transport is replaced by :class:`TrackingTransport`, which copies a sent value as a transfer
  between devices does: the receiver owns a new copy, and the sender's storage is freed when nothing
  on the sender still needs it. (The local runtime on one device would otherwise share one storage
  between two stages and charge it to one of them.)
- with fake tensors, ``GPipe.__init__``'s ``cell.to(device)`` is skipped when the cell is already
  there (``Module.to`` swaps fake parameters, which fails once anything holds a weak reference).

The step measured is a steady-state step: the optimizers are primed first (their state exists, as
from the second step on), and ``.grad`` is cleared at the step's start, as the engine does.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from gpipe_repro.engine import boundary
from gpipe_repro.engine.arguments import declared_reduction
from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.engine.local_runtime import LocalRuntime, LocalTransport
from gpipe_repro.engine.schedule import Action, ActionKind
from gpipe_repro.engine.stage import StageExecutor
from gpipe_repro.memory.compose import ACTIVATIONS, BUFFERS, GRADS, OPTIMIZER, PARAMS, STASH, StageMemory
from gpipe_repro.memory.fake import fake_layers, fake_value
from gpipe_repro.memory.profile import OptimizerFactory, rmsprop
from gpipe_repro.memory.tracker import MemoryTracker

TRANSIT = "transit"
_CATEGORY = {ActionKind.RECV_ACT: STASH, ActionKind.OPTIMIZER_STEP: OPTIMIZER}


class TrackingTransport(LocalTransport):
    """A LocalTransport whose sends copy, charged to the link until the receiver takes them."""

    def __init__(self, devices: list[torch.device], tracker: MemoryTracker,
                 label: Sequence[int] | None = None) -> None:
        super().__init__(devices)
        self.tracker = tracker
        self.label = list(label) if label is not None else list(range(len(devices)))

    def _copy(self, value: Any) -> Any:
        with self.tracker.scope(TRANSIT, TRANSIT):
            return boundary.map_tensors(value, lambda t: t.detach().clone())

    def send_activation(self, stage: int, microbatch: int, value: Any) -> None:
        super().send_activation(stage, microbatch, self._copy(value))

    def recv_activation(self, stage: int, microbatch: int) -> Any:
        value = self.box.pop(Action(ActionKind.RECV_ACT, stage, microbatch))
        self.tracker.move(value, self.label[stage], STASH)
        return boundary.map_tensors(value, lambda t: t.detach().requires_grad_(boundary.carries_grad(t)))

    def send_gradient(self, stage: int, microbatch: int, grads: list[torch.Tensor | None]) -> None:
        super().send_gradient(stage, microbatch, [None if g is None else self._copy(g) for g in grads])

    def recv_gradient(self, stage: int, microbatch: int) -> list[torch.Tensor | None]:
        grads = self.box.pop(Action(ActionKind.RECV_GRAD, stage, microbatch))
        self.tracker.move(grads, self.label[stage], ACTIVATIONS)
        return grads


@dataclass(frozen=True)
class StepTrace:
    """Per-stage memory of one measured step, and the whole process's peak."""

    stages: list[StageMemory]
    total_peak: int            # all stages (and transfers) together: one device holding every cell
    balance: list[int]
    fake: bool


def _instrument(executor: StageExecutor, tracker: MemoryTracker, params: list[torch.Tensor],
                label: int) -> None:
    """Each action in its tracker scope (charged to `label`: the stage, or its device); after it,
    the parameters' gradients counted as gradients (not through gradient hooks, which would change
    what the engine runs: a zero-bubble split defers the weight gradients of parameters without
    hooks differently)."""
    run = executor.execute
    stage = label

    def execute(action: Action) -> None:
        tracker.begin(stage, str(action))
        with tracker.scope(stage, _CATEGORY.get(action.kind, ACTIVATIONS)):
            run(action)
        tracker.recategorize([p.grad for p in params if p.grad is not None], GRADS)
        tracker.mark(stage)

    executor.execute = execute  # type: ignore[method-assign]  # instrumenting this one executor


@contextlib.contextmanager
def _skip_same_device_moves() -> Iterator[None]:
    """``nn.Sequential.to(d)`` returns the module itself when every tensor is already on `d`."""
    original = nn.Sequential.to

    def to(self: nn.Sequential, *args: Any, **kwargs: Any) -> nn.Sequential:
        device = args[0] if args and not kwargs else kwargs.get("device")
        if isinstance(device, (str, torch.device)) and all(
                t.device == torch.device(device) for t in list(self.parameters()) + list(self.buffers())):
            return self
        return original(self, *args, **kwargs)

    nn.Sequential.to = to  # type: ignore[method-assign,assignment]  # patched for this block only
    try:
        yield
    finally:
        nn.Sequential.to = original  # type: ignore[method-assign]  # restoring the patch


def prime_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """Create the optimizer's state with a zero-gradient step (the weights do not move for RMSProp
    or SGD without weight decay), then clear the gradients. Only for the parameters that train: a
    frozen one never gets a gradient, so training never gives it state (primed, it did, and a
    model with frozen layers measured its optimizer state twice what training holds)."""
    if optimizer is None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in params:
        p.grad = None


def trace_step(layers: Sequence[nn.Module], sample: Any, target: Any,
               loss_fn: Callable[[Any, Any], torch.Tensor], partitions: int, micro_batches: int,
               checkpoint: str = "except_last", balance: Sequence[int] | None = None,
               optimizer: OptimizerFactory | None = rmsprop, schedule: str = "gpipe",
               fake: bool = True, attention: str = "fused", copy_layers: bool = True,
               round_to: int = 1, split_backwards: int | None = None,
               per_device: bool = False) -> StepTrace:
    """Run one steady-state training step of GPipe and measure each stage's memory (`schedule` and
    `split_backwards` as GPipe takes them); with `per_device`, each device's (process's), which runs
    two cells in the interleaved and V schedules: ``stages`` then holds one entry per device.

    With ``fake=True`` layers (any device, meta included) and batches are replaced by fake copies
    and nothing is allocated. With ``fake=False`` the step really runs (on copies of the layers
    unless ``copy_layers=False``)."""
    with ExitStack() as stack:
        if fake:
            mode = FakeTensorMode()
            layer_list = fake_layers(list(layers), mode)
            sample, target = fake_value(sample, mode), fake_value(target, mode)
            stack.enter_context(mode)
        else:
            layer_list = copy.deepcopy(list(layers)) if copy_layers else list(layers)
        if attention == "math":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        if fake:
            stack.enter_context(_skip_same_device_moves())
        # the reduction declared, so the first step's check of an undeclared one (engine/losses.py,
        # two rows' extra loss) does not add to the memory traced
        pipe = GPipe(layer_list, partitions=partitions, micro_batches=micro_batches,
                     checkpoint=checkpoint, balance=balance, loss_fn=loss_fn, optimizer=optimizer,
                     schedule=schedule, split_backwards=split_backwards,
                     loss_reduction=declared_reduction(loss_fn) or "mean")
        tracker = MemoryTracker(round_to=round_to)
        label = pipe.make_schedule().process_of() if per_device else list(range(len(pipe.cells)))
        transport = TrackingTransport(pipe.devices, tracker, label)
        assert isinstance(pipe.runtime, LocalRuntime)
        pipe.runtime.use_transport(transport)   # instrumentation: see the module docstring
        for s, (executor, cell, opt) in enumerate(zip(pipe.executors, pipe.cells, pipe.optimizers)):
            prime_optimizer(opt)
            tracker.register(list(cell.parameters()), label[s], PARAMS)
            tracker.register(list(cell.buffers()), label[s], BUFFERS)
            if opt is not None:
                tracker.register([v for st in opt.state.values() for v in st.values()
                                  if isinstance(v, torch.Tensor)], label[s], OPTIMIZER)
            _instrument(executor, tracker, list(cell.parameters()), label[s])
        tracker.reset_peaks()
        with tracker:
            pipe.train_step(sample, target)
        stages = []
        for s in range(max(label) + 1):
            d = tracker.devices[s]
            stages.append(StageMemory(s, d.peak, dict(d.peak_parts), d.peak_at,
                                      [(mk.label, mk.live, mk.peak) for mk in d.timeline]))
        return StepTrace(stages, tracker.total_peak, list(pipe.balance), fake)
