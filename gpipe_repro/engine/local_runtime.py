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

from gpipe_repro.engine import boundary, microbatch
from gpipe_repro.engine.agreement import Agreement, Contribution, StepConfig
from gpipe_repro.engine.driver import drive
from gpipe_repro.engine.rng import preserved_rng
from gpipe_repro.engine.schedule import RECVS, Action, ActionKind, Schedule, ScheduleError
from gpipe_repro.engine.stage import StageExecutor
from gpipe_repro.engine.tied import Tie, refuse_copies_diverged_in_step, sum_tied_gradients
from gpipe_repro.engine.timeline import Timeline, wall_clock

__all__ = ["LocalTransport", "LocalRuntime", "run_local"]


class LocalTransport:
    """Stage-to-stage mailbox inside one process."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self.box: dict[Action, Any] = {}
        self.agreed: Contribution | None = None   # the stages' summed contributions, set by run_local

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

    def agree(self, stage: int, contribution: Callable[[], Contribution]) -> Contribution:
        if self.agreed is None:
            raise RuntimeError(f"stage {stage} reached AGREE outside the local runtime's barrier")
        return self.agreed


def run_local(schedule: Schedule, executors: list[StageExecutor], transport: LocalTransport,
              ties: Sequence[Tie] = ()) -> None:
    """Execute `schedule` over `executors` (one per stage) in this process; `ties`: the parameters
    whose copies in several cells get the sum of their gradients at AGREE."""
    transport.agreed = None

    def barrier(waiting: list[tuple[int, Action]]) -> None:
        if transport.agreed is None:   # once per step: every stage's contribution, summed
            cells = {e.stage: e.cell for e in executors}
            refuse_copies_diverged_in_step(ties, cells, {e.stage: e.tied_versions for e in executors})
            sum_tied_gradients(ties, cells)
            transport.agreed = Contribution.total(e.contribution() for e in executors)
        for _, a in waiting:            # every process's AGREE before any update
            executors[a.stage].execute(a)

    def stuck(blocked: list[Action]) -> ScheduleError:
        names = [f"{a}@stage{a.stage}" for a in blocked]
        return ScheduleError(f"local runtime: no stage can proceed ({', '.join(names)})")

    # A stage's actions run on executors[stage]; stages take turns one FORWARD / BACKWARD at a time.
    drive(schedule.programs(), run=lambda p, a: executors[a.stage].execute(a), barrier=barrier,
          stuck=stuck, ready=lambda p, a: a.kind not in RECVS or transport.ready(a),
          yield_after=lambda p, a: a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD))


class LocalRuntime:
    """Every stage of the pipeline in this process (see the module docstring); a
    :class:`~gpipe_repro.engine.runtime.Runtime`.

    Args:
        executors: one per stage, in order; they are given this runtime's transport.
        devices: each stage's device (a list this runtime keeps current, :meth:`move_to`).
        ties: the parameters tied across cells (:mod:`gpipe_repro.engine.tied`).
    """

    def __init__(self, executors: list[StageExecutor], devices: list[torch.device],
                 ties: Sequence[Tie] = ()) -> None:
        self.executors, self.devices, self.ties = executors, list(devices), list(ties)
        self.record = False
        self.last_timeline: Timeline | None = None
        self.use_transport(LocalTransport(self.devices))

    def use_transport(self, transport: LocalTransport) -> None:
        """Carry values between the stages through `transport` (an instrumented mailbox, say)."""
        self.transport = transport
        for e in self.executors:
            e.use_transport(transport)

    def check_same_batch(self, key: Any, call: str = "train_step") -> None:
        """One process: every stage has the batch."""

    def any_process(self, flags: Sequence[bool]) -> list[bool]:
        """One process: its own flags."""
        return list(flags)

    def train_step(self, schedule: Schedule, step: int, microbatches: list[Any], targets: list[Any],
                   weights: list[float | torch.Tensor], config: StepConfig) -> Agreement:
        self._run(schedule, step, microbatches, targets, weights, config)
        for e in self.executors:
            e.end_step()
        agreement = self.executors[-1].agreement
        assert agreement is not None
        return agreement

    def forward(self, schedule: Schedule, step: int, microbatches: list[Any], config: StepConfig) -> Any:
        self._run(schedule, step, microbatches, None, None, config)
        last = self.executors[-1]
        return microbatch.join([last.outputs[i] for i in range(len(microbatches))],
                               [microbatch.batch_size(mb) for mb in microbatches])

    def move_to(self, devices: Sequence[torch.device]) -> None:
        self.devices[:] = devices
        for e in self.executors:
            e.move_to(self.devices[e.stage])

    def reseed(self, seed: int) -> None:
        for e in self.executors:
            e.reseed(seed)

    def _run(self, schedule: Schedule, step: int, mbs: list[Any], tgts: list[Any] | None,
             weights: list[float | torch.Tensor] | None, config: StepConfig) -> None:
        clock = wall_clock() if self.record else None
        for e in self.executors:
            e.begin_step(step, schedule, mbs if e.stage == 0 else None, tgts if e.is_last else None,
                         weights if e.is_last else None, config, clock=clock)
        self.transport.box.clear()
        try:
            with preserved_rng(self.devices):
                run_local(schedule, self.executors, self.transport, self.ties)
        except BaseException:
            for e in self.executors:   # all-or-nothing: drop what the failed step accumulated
                for bn in e.batchnorms:
                    bn.discard()
            raise
        if clock is not None:
            events = [ev for e in self.executors for ev in e.events]
            self.last_timeline = Timeline(len(self.executors), events,
                                          {"runtime": "local", "schedule": schedule.name})
