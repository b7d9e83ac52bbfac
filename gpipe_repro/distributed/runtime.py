"""The distributed runtime: this process runs ONE stage of the schedule, the others run theirs.

Rank s executes ``schedule.stages[s]`` in order through the one
:class:`~gpipe_repro.engine.stage.StageExecutor` (the same code the local runtime uses), with a
:class:`~gpipe_repro.distributed.transport.ProcessGroupTransport` carrying boundary values: a SEND
returns at once, a RECV blocks until its value has arrived. Nothing here decides what runs when; with
``recompute_ahead`` the schedule itself puts each RECOMPUTE before the RECV_GRAD it used to follow,
and this runtime simply executes it there, so the recomputation overlaps the wait for the gradient.

Each training step has one collective: the schedule's AGREE, right before the optimizer step, is a
small all-reduce (five float64 numbers: the loss, its count, the squared gradient norm, an overflow
flag) on the control group, after this rank's sends have completed. It is the step's only
synchronization point and its commit point: no rank updates before every rank has finished every
action of the step, and every rank gets the same loss, global gradient norm and overflow verdict. A
rank that fails before it leaves the others waiting there (their receives or the all-reduce time out,
and the launcher ends the job), so a failed step updates no rank. With ``record`` every action is
timestamped on one
clock (:mod:`gpipe_repro.distributed.clock`) and the ranks' events are merged into one
:class:`~gpipe_repro.engine.timeline.Timeline` on every rank, receives carrying ``ready`` (when the
matching send started) so the breakdown can tell waiting for a producer from moving bytes.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from gpipe_repro.distributed.clock import clock_offset
from gpipe_repro.distributed.process_group import (
    StageContext,
    broadcast_object,
    control_group,
    init_distributed,
)
from gpipe_repro.distributed.transport import ProcessGroupTransport, signature
from gpipe_repro.engine import boundary, microbatch
from gpipe_repro.engine.rng import preserved_rng
from gpipe_repro.engine.schedule import COMPUTE, RECVS, SENDS, Action, ActionKind, Schedule, ScheduleError
from gpipe_repro.engine.stage import Agreement, StageExecutor, StepConfig
from gpipe_repro.engine.timeline import Event, Timeline

__all__ = ["StageProcess", "init_distributed", "broadcast_object"]  # what GPipe(runtime=...) loads


class StageProcess:
    """This rank's stage of a pipeline (see the module docstring)."""

    def __init__(self, executor: StageExecutor, context: StageContext, prepost: bool = True) -> None:
        if executor.stage != context.rank:
            raise ValueError(f"rank {context.rank} was given the executor of stage {executor.stage}")
        self.executor, self.context = executor, context
        self.rank, self.num_stages = context.rank, executor.num_stages
        # Control messages (clock, loss, timelines, inference outputs) go over a CPU group.
        self.control = control_group()
        self.transport = ProcessGroupTransport(context, prepost=prepost, agree_group=self.control)
        executor.transport = self.transport
        self.record = False
        self.last_timeline: Timeline | None = None
        self.last_step_time: float | None = None
        self._offset: float | None = None
        self._offset_estimate = 0.0
        self._checked: set[tuple[str, int]] = set()

    # -- steps --------------------------------------------------------------------------------------
    def train_step(self, schedule: Schedule, step: int, microbatches: list[Any], targets: list[Any],
                   weights: list[float], config: StepConfig | None = None) -> Agreement:
        """Run this rank's actions for one mini-batch; return what the ranks agreed on (the same on
        every rank: the mini-batch loss, the global gradient norm, whether the update was skipped)."""
        start = self._run(schedule, step, microbatches, targets, weights, config)
        self.executor.end_step()
        self._finish(start, schedule)
        assert self.executor.agreement is not None
        return self.executor.agreement

    def forward(self, schedule: Schedule, step: int, microbatches: list[Any],
                config: StepConfig | None = None) -> Any:
        """Pipelined inference; the whole batch's output on every rank (on its device)."""
        start = self._run(schedule, step, microbatches, None, None, config)
        out = None
        if self.executor.is_last:
            out = microbatch.join([self.executor.outputs[i] for i in range(len(microbatches))])
        box = [None if out is None else boundary.map_tensors(out, lambda t: t.cpu())]
        dist.broadcast_object_list(box, src=self.num_stages - 1, group=self.control)
        self._finish(start, schedule)
        return boundary.map_tensors(box[0], lambda t: t.to(self.context.device))

    # -- internals ----------------------------------------------------------------------------------
    def _run(self, schedule: Schedule, step: int, microbatches: list[Any], targets: list[Any] | None,
             weights: list[float] | None, config: StepConfig | None = None) -> float:
        if schedule.processes is not None:   # the same check on every rank: no rank waits on another
            raise ScheduleError(f"schedule {schedule.name!r} puts several stages on one process; the "
                                "distributed runtime runs one stage per process for now: use "
                                "runtime='local' for it, or schedule='1f1b' / 'zb-h1' here")
        if schedule.num_stages != self.num_stages:
            raise ScheduleError(f"a schedule for {schedule.num_stages} stages on a job of "
                                f"{self.num_stages} stage processes")
        self._check_link_order(schedule)
        if self.record and self._offset is None:
            self._offset, self._offset_estimate = clock_offset(self.control)
        ex = self.executor
        cuda = self.context.device.type == "cuda"
        ex.clock = (self._device_clock if cuda else self._clock) if self.record else None
        start = self._clock()
        ex.begin_step(step, schedule, microbatches if ex.stage == 0 else None,
                      targets if ex.is_last else None, weights if ex.is_last else None, config)
        actions = schedule.stages[self.rank]
        self.transport.begin_step(signature(microbatches, schedule.training), actions)
        try:
            with preserved_rng([self.context.device]):
                for a in actions:
                    if a.kind in COMPUTE:
                        self.transport.release_sent()
                    ex.execute(a)
        except BaseException:
            for bn in ex.batchnorms:   # all-or-nothing: drop what the failed step accumulated
                bn.discard()
            raise
        self.transport.finish_step()
        if self.context.device.type == "cuda":
            torch.cuda.synchronize(self.context.device)  # the step is over when its kernels are
        return start

    def _finish(self, start: float, schedule: Schedule) -> None:
        self.last_step_time = self._clock() - start
        if self.record:
            self.last_timeline = self._gather_timeline(start, schedule)

    def _clock(self) -> float:
        return time.perf_counter() + (self._offset or 0.0)

    def _device_clock(self) -> float:
        """The clock for recorded actions: on CUDA, first wait for the queued kernels, so an action's
        end is when its work ended, not when it was queued (recording costs that overlap)."""
        torch.cuda.synchronize(self.context.device)
        return self._clock()

    def _gather_timeline(self, start: float, schedule: Schedule) -> Timeline:
        mine = (start, [(e.kind, e.microbatch, e.start, e.end) for e in self.executor.events],
                (self._offset, self._offset_estimate))
        everyone: list[Any] = [None] * self.num_stages
        dist.all_gather_object(everyone, mine, group=self.control)
        return merge_timelines([(s, evs) for s, evs, _ in everyone], {
            "runtime": "distributed", "schedule": schedule.name, "backend": self.context.backend,
            "microbatches": schedule.num_microbatches,
            "clock_offset_applied_s": [o[0] for _, _, o in everyone],
            "clock_offset_estimated_s": [o[1] for _, _, o in everyone]})

    def _check_link_order(self, schedule: Schedule) -> None:
        """NCCL matches messages between two ranks in order (tags are ignored): check the schedule
        sends in the order the neighbour receives. gloo matches by tag and needs no check."""
        if self.context.backend == "gloo" or (schedule.name, schedule.num_microbatches) in self._checked:
            return
        sends: dict[tuple[int, int], list[Action]] = defaultdict(list)
        recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
        for actions in schedule.stages:
            for a in actions:
                if a.kind in SENDS:
                    sends[(a.stage, a.peer().stage)].append(a.peer())
                elif a.kind in RECVS:
                    recvs[(a.peer().stage, a.stage)].append(a)
        for link, order in sends.items():
            if order != recvs[link]:
                raise ScheduleError(f"schedule {schedule.name!r}: stage {link[0]} sends to stage "
                                    f"{link[1]} in a different order than it receives; NCCL would "
                                    "mismatch the messages")
        self._checked.add((schedule.name, schedule.num_microbatches))


def merge_timelines(per_rank: list[tuple[float, list[tuple[str, int | None, float, float]]]],
                    meta: dict[str, Any]) -> Timeline:
    """One Timeline from each rank's (step start, [(kind, micro-batch, start, end)]), all on one
    clock: times become seconds from the earliest step start, receives get ``ready``."""
    origin = min(start for start, _ in per_rank)
    events = [Event(stage, kind, mb, s - origin, e - origin)
              for stage, (_, evs) in enumerate(per_rank) for kind, mb, s, e in evs]
    send_start = {(e.stage, e.kind, e.microbatch): e.start for e in events
                  if e.kind in (ActionKind.SEND_ACT.value, ActionKind.SEND_GRAD.value)}
    for e in events:
        if e.kind == ActionKind.RECV_ACT.value:
            e.ready = send_start.get((e.stage - 1, ActionKind.SEND_ACT.value, e.microbatch))
        elif e.kind == ActionKind.RECV_GRAD.value:
            e.ready = send_start.get((e.stage + 1, ActionKind.SEND_GRAD.value, e.microbatch))
    return Timeline(len(per_rank), events, meta)

