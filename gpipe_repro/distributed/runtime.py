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
from gpipe_repro.distributed.data_parallel import (
    BATCHNORM_STATS,
    DEFAULT_BUCKET_CAP_MB,
    GradientReducer,
    sync_batchnorm_stats,
)
from gpipe_repro.distributed.groups import Layout, build_groups
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

# what GPipe(runtime=...) loads
__all__ = ["StageProcess", "init_distributed", "broadcast_object", "Layout"]


class StageProcess:
    """This rank's stage of a pipeline (see the module docstring)."""

    def __init__(self, executor: StageExecutor, context: StageContext, prepost: bool = True, *,
                 layout: Layout | None = None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                 batchnorm_stats: str = "per_replica") -> None:
        layout = layout or Layout(executor.num_stages, 1)
        if executor.stage != layout.stage_of(context.rank):
            raise ValueError(f"rank {context.rank} was given the executor of stage {executor.stage}")
        if batchnorm_stats not in BATCHNORM_STATS:
            raise ValueError(f"batchnorm_stats must be one of {BATCHNORM_STATS}, got {batchnorm_stats!r}")
        self.executor, self.context, self.layout = executor, context, layout
        self.rank, self.num_stages = executor.stage, executor.num_stages   # rank: this rank's stage
        self.global_rank, self.replica = context.rank, layout.replica_of(context.rank)
        # Control messages (clock, loss, timelines, inference outputs) go over a CPU group.
        self.control = control_group()
        # Replicas: every rank creates every group, in the same order (groups.build_groups).
        self.groups = build_groups(layout) if layout.replicas > 1 else None
        self.transport = ProcessGroupTransport(context, prepost=prepost, agree_group=self.control,
                                               rank_offset=layout.rank(replica=self.replica, stage=0),
                                               counts_norm=self.replica == 0)
        executor.transport = self.transport
        self.reducer: GradientReducer | None = None
        self.batchnorm_stats = batchnorm_stats
        if self.groups is not None:
            self.reducer = GradientReducer(list(executor.cell.parameters()),
                                           group=self.groups.data_parallel,
                                           ranks=layout.data_parallel_ranks(self.rank), rank=context.rank,
                                           timeout_s=context.timeout_s, bucket_cap_mb=bucket_cap_mb)
        self._agreed_batches: set[Any] = set()
        self.record = False
        self.last_timeline: Timeline | None = None
        self.last_step_time: float | None = None
        self._offset: float | None = None
        self._offset_estimate = 0.0
        self._checked: set[tuple[str, int]] = set()

    def check_same_batch(self, key: Any) -> None:
        """Replicas: before any work, check every rank was given the same global mini-batch (its
        batch size, shapes and dtypes, `key`). Collective over the job the first time a rank sees a
        key (a rank can only know a key others do not after a step that already failed this check)."""
        if key in self._agreed_batches:
            return
        everyone: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(everyone, key, group=self.control)
        odd = [r for r, k in enumerate(everyone) if k != everyone[0]]
        if odd:
            raise ValueError(
                f"the ranks were given different mini-batches (ranks {odd} differ from rank 0): with "
                f"replicas, every rank must call train_step/forward with the same GLOBAL mini-batch "
                f"(same batch size, shapes and dtypes); each replica takes its slice of it. "
                f"rank 0: {str(everyone[0])[:300]}; rank {odd[0]}: {str(everyone[odd[0]])[:300]}")
        self._agreed_batches.add(key)

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
        if self.groups is None:
            dist.broadcast_object_list(box, src=self.num_stages - 1, group=self.control)
        else:   # each pipeline shares its replica's output, then the replicas exchange theirs
            if self.num_stages > 1:
                last = self.layout.rank(replica=self.replica, stage=self.num_stages - 1)
                dist.broadcast_object_list(box, src=last, group=self.groups.pipeline)
            parts: list[Any] = [None] * self.layout.replicas
            dist.all_gather_object(parts, box[0], group=self.groups.data_parallel)
            box = [microbatch.join(parts)]
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
        ex.microbatch_offset = self.replica * len(microbatches)   # global micro-batch numbers (RNG)
        self.transport.begin_step(signature(microbatches, schedule.training), actions)
        # Replicas: the stage's gradients are final after its last backward; sum them from there.
        last_backward = max((i for i, a in enumerate(actions) if a.kind.value.startswith("backward")),
                            default=None) if self.reducer is not None else None
        reduce_start = 0.0
        try:
            with preserved_rng([self.context.device]):
                for i, a in enumerate(actions):
                    if a.kind in COMPUTE:
                        self.transport.release_sent()
                    if a.kind is ActionKind.AGREE and self.reducer is not None:
                        if not self.reducer.started:
                            self.reducer.start()
                        self._finish_replicas(reduce_start)
                    if i == last_backward and self.reducer is not None:
                        reduce_start = self._now()   # buckets may leave during this backward
                        self.reducer.clock = ex.clock
                        self.reducer.arm()
                    ex.execute(a)
                    if i == last_backward and self.reducer is not None:
                        self.reducer.start()
        except BaseException:
            for bn in ex.batchnorms:   # all-or-nothing: drop what the failed step accumulated
                bn.discard()
            if self.reducer is not None:
                self.reducer.discard()
            raise
        self.transport.finish_step()
        if self.context.device.type == "cuda":
            torch.cuda.synchronize(self.context.device)  # the step is over when its kernels are
        return start

    def _now(self) -> float:
        clock = self.executor.clock
        return clock() if clock is not None else 0.0

    def _finish_replicas(self, reduce_start: float) -> None:
        """At AGREE: wait for the gradient all-reduce (and merge BatchNorm statistics when asked);
        recorded as one "allreduce" event from its launch to its completion being observed."""
        assert self.reducer is not None and self.groups is not None
        self.reducer.finish()
        if self.batchnorm_stats == "synchronized" and self.executor.batchnorms:
            sync_batchnorm_stats(self.executor.cell, self.groups.data_parallel, self.layout.replicas)
        if self.executor.clock is not None:
            launched = self.reducer.first_launch
            self.executor.events.append(Event(self.rank, "allreduce", None,
                                              reduce_start if launched is None else launched,
                                              self.executor.clock()))

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
        everyone: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(everyone, mine, group=self.control)
        # With replicas, one row per global rank (replica r's stage s is row r*K + s).
        return merge_timelines([(s, evs) for s, evs, _ in everyone], {
            "runtime": "distributed", "schedule": schedule.name, "backend": self.context.backend,
            "stages": self.num_stages, "replicas": self.layout.replicas,
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

