"""The local runtime: every stage in one process, one device per cell (or all on one device).

It executes the schedule's programs through the one driver loop (:mod:`gpipe_repro.engine.driver`),
interleaving stages one compute action at a time. A receive whose value has not been sent yet
simply waits for a later round; if a whole round makes no progress the schedule was wrong, and we
say which actions are stuck instead of hanging.

Values travel through :class:`LocalTransport`, a mailbox; moving them to the next cell's device is
the only "communication". On a multi-GPU host kernels are queued asynchronously on each device, so
stages overlap for real even though one Python thread drives them. On a single device with K cells
this is the paper's "Pipeline-1": re-materialization without parallelism.

AGREE is a barrier: a stage that reaches it waits until every stage has; then the runtime gives
each copy of a tied parameter the sum of the copies' gradients (:mod:`gpipe_repro.engine.tied`),
sums the stages' contributions once and runs every stage's AGREE (each reads that sum) before any
stage's update. An exception in any action up to and including AGREE propagates from :func:`run_local`
before any cell has updated. The updates themselves (OPTIMIZER_STEP) are the commit: an optimizer
whose own ``step()`` raises is not rolled back.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpipe_repro.engine import boundary
from gpipe_repro.engine.driver import drive
from gpipe_repro.engine.schedule import RECVS, Action, ActionKind, Schedule, ScheduleError
from gpipe_repro.engine.stage import StageExecutor
from gpipe_repro.engine.tied import Tie, sum_tied_gradients

__all__ = ["LocalTransport", "run_local"]


class LocalTransport:
    """Stage-to-stage mailbox inside one process."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self.box: dict[Action, Any] = {}
        self.agreed: list[float] | None = None   # the summed AGREE vector, set by run_local

    def ready(self, action: Action) -> bool:
        return action in self.box

    def send_activation(self, stage: int, microbatch: int, value: Any) -> None:
        self.box[Action(ActionKind.RECV_ACT, stage + 1, microbatch)] = value

    def recv_activation(self, stage: int, microbatch: int) -> Any:
        value = self.box.pop(Action(ActionKind.RECV_ACT, stage, microbatch))
        return boundary.attach(value, self.devices[stage])

    def send_gradient(self, stage: int, microbatch: int, grads: list[torch.Tensor | None]) -> None:
        self.box[Action(ActionKind.RECV_GRAD, stage - 1, microbatch)] = grads

    def recv_gradient(self, stage: int, microbatch: int) -> list[torch.Tensor | None]:
        grads = self.box.pop(Action(ActionKind.RECV_GRAD, stage, microbatch))
        device = self.devices[stage]
        return [None if g is None else g.to(device, non_blocking=True) for g in grads]

    def agree(self, stage: int, contribution: Callable[[], list[float]]) -> list[float]:
        if self.agreed is None:
            raise RuntimeError(f"stage {stage} reached AGREE outside the local runtime's barrier")
        return self.agreed


def run_local(schedule: Schedule, executors: list[StageExecutor], transport: LocalTransport,
              ties: Sequence[Tie] = ()) -> None:
    """Execute `schedule` over `executors` (one per stage) in this process; `ties`: the parameters
    whose copies in several cells get the sum of their gradients at AGREE."""
    transport.agreed = None

    def barrier(waiting: list[tuple[int, Action]]) -> None:
        if transport.agreed is None:   # once per step: every stage's vector, summed
            sum_tied_gradients(ties, {e.stage: e.cell for e in executors})
            transport.agreed = [sum(col) for col in zip(*(e.contribution() for e in executors))]
        for _, a in waiting:            # every process's AGREE before any update
            executors[a.stage].execute(a)

    def stuck(blocked: list[Action]) -> ScheduleError:
        names = [f"{a}@stage{a.stage}" for a in blocked]
        return ScheduleError(f"local runtime: no stage can proceed ({', '.join(names)})")

    # A stage's actions run on executors[stage]; stages take turns one FORWARD / BACKWARD at a time.
    drive(schedule.programs(), run=lambda p, a: executors[a.stage].execute(a), barrier=barrier,
          stuck=stuck, ready=lambda p, a: a.kind not in RECVS or transport.ready(a),
          yield_after=lambda p, a: a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD))
