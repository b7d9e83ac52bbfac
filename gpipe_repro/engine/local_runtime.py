"""The local runtime: every stage in one process, one device per cell (or all on one device).

It executes the schedule's per-stage action lists directly, interleaving stages one compute action at
a time. A receive whose value has not been sent yet simply waits for a later round; if a whole round
makes no progress the schedule was wrong, and we say which actions are stuck instead of hanging.

Values travel through :class:`LocalTransport`, a mailbox; moving them to the next cell's device is
the only "communication". On a multi-GPU host kernels are queued asynchronously on each device, so
stages overlap for real even though one Python thread drives them. On a single device with K cells
this is the paper's "Pipeline-1": re-materialization without parallelism.

AGREE is a barrier: a stage that reaches it waits until every stage has; then the runtime sums the
stages' contributions once and runs every stage's AGREE (each reads that sum) before any stage's
update. An exception in any action up to and including AGREE propagates from :func:`run_local`
before any cell has updated. The updates themselves (OPTIMIZER_STEP) are the commit: an optimizer
whose own ``step()`` raises is not rolled back.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpipe_repro.engine import boundary
from gpipe_repro.engine.schedule import BARRIERS, RECVS, Action, ActionKind, Schedule, ScheduleError
from gpipe_repro.engine.stage import StageExecutor

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


def run_local(schedule: Schedule, executors: list[StageExecutor], transport: LocalTransport) -> None:
    """Execute `schedule` over `executors` (one per stage) in this process."""
    programs = schedule.programs()   # one per process; a stage's actions run on executors[stage]
    pcs = [0] * len(programs)
    remaining = sum(len(a) for a in programs)
    transport.agreed = None
    while remaining:
        progressed = False
        for s, actions in enumerate(programs):
            # Run this stage up to and including its next compute action, or until it must wait.
            while pcs[s] < len(actions):
                a = actions[pcs[s]]
                if (a.kind in RECVS and not transport.ready(a)) or (
                        a.kind in BARRIERS and transport.agreed is None):
                    break
                executors[a.stage].execute(a)
                pcs[s] += 1
                remaining -= 1
                progressed = True
                if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
                    break
        if not progressed and transport.agreed is None and all(
                pcs[s] < len(st) and st[pcs[s]].kind in BARRIERS for s, st in enumerate(programs)):
            transport.agreed = [sum(col) for col in zip(*(e.contribution() for e in executors))]
            for s, actions in enumerate(programs):   # every AGREE before any update
                executors[actions[pcs[s]].stage].execute(actions[pcs[s]])
                pcs[s] += 1
                remaining -= 1
            progressed = True
        if not progressed:
            stuck = [f"{st[pcs[s]]}@stage{st[pcs[s]].stage}" for s, st in enumerate(programs)
                     if pcs[s] < len(st)]
            raise ScheduleError(f"local runtime: no stage can proceed ({', '.join(stuck)})")
