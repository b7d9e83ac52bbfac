"""The distributed runtime: this process runs its program of the schedule, the others run theirs.

:class:`DistributedRuntime` is the :class:`~gpipe_repro.engine.runtime.Runtime` that
``GPipe(runtime="distributed")`` uses (``pipe.runtime``).

Process p executes ``schedule.programs()[p]`` (``schedule.stages[p]``, or with interleaved 1F1B the
actions of its several stages in their interleaved order) through the one driver loop
(:func:`gpipe_repro.engine.driver.drive`) and the one
:class:`~gpipe_repro.engine.stage.StageExecutor` per stage (the same code the local runtime uses), with a
:class:`~gpipe_repro.distributed.transport.ProcessGroupTransport` carrying boundary values: a SEND
returns at once, a RECV blocks until its value has arrived. Nothing here decides what runs when; with
``recompute_ahead`` the schedule itself puts each RECOMPUTE before the RECV_GRAD it used to follow,
and this runtime simply executes it there, so the recomputation overlaps the wait for the gradient.

Each training step has one collective: the schedule's AGREE, right before the optimizer step, is a
small all-reduce (the five float64 numbers of :class:`~gpipe_repro.engine.agreement.Contribution`:
the loss, its count and whether it has one, the squared gradient norm, an overflow flag) on the
control group, after this rank's sends have completed. It is the step's only synchronization point
and its commit point: no rank updates before every rank has finished every action of the step, and
every rank gets the same loss, global gradient norm and overflow verdict. A rank that fails before
it leaves the others waiting there (their receives or the all-reduce time out, and the launcher ends
the job), so a failed step updates no rank. Right before it come the replicas' gradient all-reduces
and, for a parameter tied across cells, one all-reduce per tie over the ranks holding a copy
(:mod:`gpipe_repro.distributed.tied`). With ``record`` every action is timestamped on one clock
(:mod:`gpipe_repro.distributed.clock`) and the ranks' events are merged into one
:class:`~gpipe_repro.engine.timeline.Timeline` on every rank, receives carrying ``ready`` (when the
matching send started) so the breakdown can tell waiting for a producer from moving bytes.
"""
from __future__ import annotations

import datetime
import hashlib
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gpipe_repro.distributed.clock import clock_offset, merge_timelines
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
    gather_object,
    init_distributed,
)
from gpipe_repro.distributed.tied import TiedGradientReducer
from gpipe_repro.distributed.transport import ProcessGroupTransport, signature
from gpipe_repro.distributed.watchdog import PeerFailure
from gpipe_repro.engine import boundary, microbatch
from gpipe_repro.engine.agreement import Agreement, StepConfig
from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.driver import drive
from gpipe_repro.engine.rng import preserved_rng
from gpipe_repro.engine.schedule import (
    COMPUTE,
    RECVS,
    SENDS,
    Action,
    Schedule,
    ScheduleError,
    forward_on_processes,
)
from gpipe_repro.engine.schedule.receive_window import receive_window, sends_waited_at_first_step
from gpipe_repro.engine.stage import StageExecutor
from gpipe_repro.engine.tied import Tie
from gpipe_repro.engine.timeline import Timeline

BATCH_CHECK_TAG = (1 << 30) + 1   # above every transport tag (transport._tag) on a shared group

# what GPipe(runtime=...) loads
__all__ = ["DistributedRuntime", "init_distributed", "broadcast_object", "gather_object", "Layout"]

#: what a rank is doing when it checks its batch against its neighbour's (the first word of its message)
CALLS = ("train_step", "forward", "gather_layers")


class DistributedRuntime:
    """This rank's share of a pipeline: its stage, or its stages when it runs several (see the
    module docstring); a :class:`~gpipe_repro.engine.runtime.Runtime`.

    Args:
        executor: this rank's stage executor, or the executors of all its stages.
        context: the process group context; prepost: post receives at the step's start (gloo).
        layout: the pipeline's processes x replicas (default: one process per stage, one replica).
        process_of: the process running each stage (default: stage s on process s).
        bucket_cap_mb, batchnorm_stats: replicas (see :class:`~gpipe_repro.engine.gpipe.GPipe`).
        ties: the model's parameters tied across cells (:mod:`gpipe_repro.engine.tied`): their
            copies' gradients are summed over the processes holding them before AGREE.
    """

    def __init__(self, executor: StageExecutor | list[StageExecutor], context: StageContext,
                 prepost: bool = True, *, layout: Layout | None = None,
                 process_of: list[int] | None = None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                 batchnorm_stats: str = "per_replica", ties: Sequence[Tie] = ()) -> None:
        executors = sorted([executor] if isinstance(executor, StageExecutor) else executor,
                           key=lambda e: e.stage)
        num_stages = executors[0].num_stages
        self.process_of = list(process_of) if process_of is not None else list(range(num_stages))
        self._windows: dict[tuple[tuple[Action, ...], ...], tuple[int, bool]] = {}
        layout = layout or Layout(max(self.process_of) + 1, 1)
        here = layout.stage_of(context.rank)
        mine = [s for s, p in enumerate(self.process_of) if p == here]
        if [e.stage for e in executors] != mine:
            raise ValueError(f"rank {context.rank} runs stages {mine} but was given the executors of "
                             f"stages {[e.stage for e in executors]}")
        if len(executors) > 1 and layout.replicas > 1:
            raise ValueError("replicas of a pipeline whose processes hold several stages are not "
                             "supported: use replicas=1")
        require_one_of("batchnorm_stats", batchnorm_stats, BATCHNORM_STATS)
        executor = executors[0]
        self.executors, self.executor, self.context, self.layout = executors, executor, context, layout
        # rank: this rank's process in its pipeline (its stage when it runs one)
        self.rank, self.num_stages = here, num_stages
        self.global_rank, self.replica = context.rank, layout.replica_of(context.rank)
        # Control messages (clock, loss, timelines, inference outputs) go over a CPU group.
        self.control = control_group()
        # Replicas: every rank creates every group, in the same order (groups.build_groups).
        self.groups = build_groups(layout) if layout.replicas > 1 else None
        self.transport = ProcessGroupTransport(context, prepost=prepost, agree_group=self.control,
                                               rank_offset=layout.rank(replica=self.replica, stage=0),
                                               counts_norm=self.replica == 0)
        for e in executors:
            e.use_transport(self.transport)
        self.transport.contributions = [e.contribution for e in executors]
        self.reducer: GradientReducer | None = None
        self._failed: str | None = None     # what made a step fail: no step runs after it
        self.batchnorm_stats = batchnorm_stats
        if self.groups is not None:
            self.reducer = GradientReducer(list(executor.cell.parameters()),
                                           group=self.groups.data_parallel,
                                           ranks=layout.data_parallel_ranks(self.rank), rank=context.rank,
                                           timeout_s=context.timeout_s, bucket_cap_mb=bucket_cap_mb,
                                           names=dict(executor.cell.named_parameters()))
        # every rank builds the tie groups, in the same order, even one holding no copy
        self.tied = (TiedGradientReducer(ties, {e.stage: e.cell for e in executors}, layout,
                                         self.process_of, context.rank, context.timeout_s)
                     if ties else None)
        self.record = False
        self.last_timeline: Timeline | None = None
        self.last_step_time: float | None = None
        self._offset: float | None = None
        self._offset_estimate = 0.0
        self._checked: set[tuple[str, int]] = set()

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RuntimeError(
                f"rank {self.global_rank}: this distributed pipeline cannot run another step after a "
                f"failed one ({self._failed}): its peers may be gone and messages of that step may "
                "still be in flight. Its parameters are those before the failed step: end the job "
                "and start it again (resume from the last checkpoint)")

    def check_same_batch(self, key: Any, call: str = "train_step") -> None:
        """Before any work of a step, check every rank was given the same mini-batch (`key`: its
        batch size, shapes, dtypes and plain values, M and the mode; the global mini-batch with
        replicas). Every step: a rank given another batch size at step 5 would otherwise post
        receives of the wrong shapes and wait out the timeout, and the error would blame a healthy
        peer.

        A ring of point-to-point messages over the job (rank r sends a 63-bit hash of its key to
        r+1 and compares r-1's with its own): two 8-byte messages per rank and step, and a peer
        that is gone is named (a collective could not say which). A rank whose predecessor's key
        differs raises ValueError; the others then lose it and stop. The message carries the `call`
        too (train_step, forward, gather_layers): a rank in another call than its predecessor (one
        more train_step while the others gather the layers) is told so, where it would wait on
        another collective until the timeout."""
        self._check_usable()
        world, me = self.layout.world_size, self.global_rank
        if world == 1:
            return
        digest = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "big") >> 1
        mine = torch.tensor([CALLS.index(call), digest], dtype=torch.int64)
        theirs = torch.empty(2, dtype=torch.int64)
        nxt, prv = (me + 1) % world, (me - 1) % world
        timeout = datetime.timedelta(seconds=self.context.timeout_s)

        def lost(peer: int, doing: str, e: Exception) -> PeerFailure:
            self._failed = f"checking the batch, rank {peer} was gone"
            return PeerFailure(f"rank {me} lost rank {peer} while {doing} (it died, failed or did not "
                               f"answer within {self.context.timeout_s:g} s): {e}", peer)
        try:
            sent = dist.isend(mine, nxt, group=self.control, tag=BATCH_CHECK_TAG)
        except Exception as e:  # gloo: the peer's connection is gone
            raise lost(nxt, "sending it the batch check", e) from e
        try:
            received = dist.irecv(theirs, prv, group=self.control, tag=BATCH_CHECK_TAG)
            assert received is not None and sent is not None    # every rank is in the group
            received.wait(timeout)
        except Exception as e:
            raise lost(prv, "receiving its batch check", e) from e
        try:
            sent.wait(timeout)
        except Exception as e:
            raise lost(nxt, "sending it the batch check", e) from e
        if int(theirs[0]) != CALLS.index(call):
            other = CALLS[int(theirs[0])] if 0 <= int(theirs[0]) < len(CALLS) else "another call"
            raise ValueError(f"rank {me} is in {call} while rank {prv} is in {other}: every rank must "
                             "make the same calls in the same order (as many train_step and pipe(x) "
                             "calls, then gather_layers)")
        if int(theirs[1]) != digest:
            global_ = " GLOBAL" if self.layout.replicas > 1 else ""
            raise ValueError(
                f"rank {me} and rank {prv} were given different mini-batches: every rank must call "
                f"train_step/forward with the same{global_} mini-batch (same batch size, shapes and "
                "dtypes) and build GPipe with the same micro_batches"
                + ("; each replica takes its slice of it" if global_ else "")
                + f". Rank {me} has {str(key)[:300]}")

    def any_process(self, flags: Sequence[bool]) -> list[bool]:
        """Each of `flags` true where it is true on any rank of the job: one all-reduce (maximum) of
        a few integers over the control group, right after the batch check found every rank there."""
        if self.layout.world_size == 1:
            return list(flags)
        t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return [bool(v) for v in t.tolist()]

    # -- steps --------------------------------------------------------------------------------------
    def train_step(self, schedule: Schedule, step: int, microbatches: list[Any], targets: list[Any],
                   weights: list[float | torch.Tensor], config: StepConfig | None = None) -> Agreement:
        """Run this rank's actions for one mini-batch; return what the ranks agreed on (the same on
        every rank: the mini-batch loss, the global gradient norm, whether the update was skipped)."""
        start = self._run(schedule, step, microbatches, targets, weights, config)
        for e in self.executors:
            e.end_step()
        for watch in (self.reducer, self.tied):    # the copies as updated: the next step compares
            if watch is not None:
                watch.settle()
        self._finish(start, schedule)
        assert self.executor.agreement is not None
        return self.executor.agreement

    def forward(self, schedule: Schedule, step: int, microbatches: list[Any],
                config: StepConfig | None = None) -> Any:
        """Pipelined inference; the whole batch's output on every rank (on its device). A process
        holding several stages runs them in their order (:func:`forward_on_processes`)."""
        if len(self.executors) > 1:
            schedule = forward_on_processes(schedule, self.process_of)
        start = self._run(schedule, step, microbatches, None, None, config)
        out = None
        tail = self.executors[-1]
        if tail.is_last:
            out = microbatch.join([tail.outputs[i] for i in range(len(microbatches))],
                                  [microbatch.batch_size(mb) for mb in microbatches])
        box = [None if out is None else boundary.map_tensors(out, lambda t: t.cpu())]
        if self.groups is None:
            dist.broadcast_object_list(box, src=self.process_of[-1], group=self.control)
        else:   # each pipeline shares its replica's output, then the replicas exchange theirs
            if self.num_stages > 1:
                last = self.layout.rank(replica=self.replica, stage=self.num_stages - 1)
                dist.broadcast_object_list(box, src=last, group=self.groups.pipeline)
            parts: list[Any] = [None] * self.layout.replicas
            dist.all_gather_object(parts, box[0], group=self.groups.data_parallel)
            box = [microbatch.join(parts)]
        self._finish(start, schedule)
        return boundary.map_tensors(box[0], lambda t: t.to(self.context.device))

    def move_to(self, devices: Sequence[torch.device]) -> None:
        for e in self.executors:
            e.move_to(devices[e.stage])

    def reseed(self, seed: int) -> None:
        for e in self.executors:
            e.reseed(seed)

    # -- internals ----------------------------------------------------------------------------------
    def _receive_window(self, schedule: Schedule) -> tuple[int, bool]:
        """For `schedule`: the receives of each channel posted ahead, and whether sends may be waited
        for where receives are made at their actions (worked out once per schedule)."""
        programs = schedule.programs()
        known = self._windows.pop(programs, None)   # by value: inference builds a schedule per call
        if known is None:
            known = (receive_window(programs, schedule.num_microbatches),
                     sends_waited_at_first_step(programs))
        self._windows[programs] = known              # the most recent last
        while len(self._windows) > 8:
            del self._windows[next(iter(self._windows))]
        return known

    def _run(self, schedule: Schedule, step: int, microbatches: list[Any], targets: list[Any] | None,
             weights: list[float | torch.Tensor] | None, config: StepConfig | None = None) -> float:
        self._check_usable()
        programs = schedule.programs()
        placed = schedule.process_of()
        if schedule.num_stages != self.num_stages or placed != self.process_of:
            # the same check on every rank: no rank waits on another
            raise ScheduleError(f"schedule {schedule.name!r} runs {schedule.num_stages} stages on "
                                f"{len(programs)} processes (stage -> process {placed}), but this job "
                                f"was built for {self.num_stages} stages on {self.layout.stages} "
                                f"processes ({self.process_of}): build GPipe with the schedule it runs")
        self._check_link_order(schedule)
        if self.record and self._offset is None:
            self._offset, self._offset_estimate = clock_offset(self.control)
        cuda = self.context.device.type == "cuda"
        clock = (self._device_clock if cuda else self._clock) if self.record else None
        start = self._clock()
        for ex in self.executors:
            ex.begin_step(step, schedule, microbatches if ex.stage == 0 else None,
                          targets if ex.is_last else None, weights if ex.is_last else None, config,
                          clock=clock,   # global micro-batch numbers (RNG):
                          microbatch_offset=self.replica * len(microbatches))
        actions = programs[self.rank]
        by_stage = {ex.stage: ex for ex in self.executors}
        self.transport.begin_step(signature(microbatches, schedule.training), actions,
                                  None if len(programs) == schedule.num_stages else placed,
                                  *self._receive_window(schedule))
        # Replicas: the stage's gradients are final after its last backward; sum them from there.
        reducer = self.reducer
        last_backward = None
        if reducer is not None:
            last_backward = next((a for a in reversed(actions) if a.kind.value.startswith("backward")),
                                 None)
        reduce_start = [0.0]

        def run(p: int, a: Action) -> None:
            if a.kind in COMPUTE:
                self.transport.release_sent()
            if reducer is not None and a == last_backward:
                reduce_start[0] = self._now()   # buckets may leave during this backward
                reducer.clock = clock
                reducer.arm()
            by_stage[a.stage].execute(a)
            if reducer is not None and a == last_backward:
                reducer.start()

        tied_summed = [self.tied is None]

        def barrier(waiting: list[tuple[int, Action]]) -> None:
            # AGREE: one all-reduce over the job, inside this process's first AGREE (the transport
            # adds the vectors of all its stages); the barrier over processes is that collective.
            # Before it, the replicas' sum of each stage's gradients, then the tied copies' sum.
            for _, a in waiting:
                if reducer is not None:
                    if not reducer.started:
                        reducer.start()
                    self._finish_replicas(reduce_start[0])
                if not tied_summed[0] and self.tied is not None:
                    self.tied.reduce()
                    tied_summed[0] = True
                by_stage[a.stage].execute(a)

        def stuck(blocked: list[Action]) -> RuntimeError:   # unreachable: receives block in `run`
            return RuntimeError(f"rank {self.global_rank}: cannot proceed at {blocked}")

        try:
            with preserved_rng([self.context.device]):
                drive([actions], run=run, barrier=barrier, stuck=stuck)
        except BaseException as e:
            for ex in self.executors:   # all-or-nothing: drop what the failed step accumulated
                for bn in ex.batchnorms:
                    bn.discard()
            if self.reducer is not None:
                self.reducer.discard()
            self._failed = f"step {step} failed on this rank: {type(e).__name__}: {str(e)[:200]}"
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
        launched = self.reducer.first_launch
        self.executor.record_event("allreduce", reduce_start if launched is None else launched)

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
        events = sorted((e for ex in self.executors for e in ex.events), key=lambda e: e.start)
        several = len(self.executors) > 1
        mine = (start, [(e.kind, e.microbatch, e.start, e.end, e.stage if several else None)
                        for e in events],
                (self._offset, self._offset_estimate))
        everyone: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(everyone, mine, group=self.control)
        # With replicas, one row per global rank (replica r's stage s is row r*K + s).
        return merge_timelines([(s, evs) for s, evs, _ in everyone], {
            "runtime": "distributed", "schedule": schedule.name, "backend": self.context.backend,
            "stages": self.num_stages, "replicas": self.layout.replicas,
            "microbatches": schedule.num_microbatches,
            "clock_offset_applied_s": [o[0] for _, _, o in everyone],
            "clock_offset_estimated_s": [o[1] for _, _, o in everyone]},
            ranks_per_pipeline=self.layout.stages)

    def _check_link_order(self, schedule: Schedule) -> None:
        """NCCL matches messages between two ranks in order (tags are ignored): check every process
        sends to another in the order that one receives (over all the stages they run). gloo matches
        by tag and needs no check."""
        if self.context.backend == "gloo" or (schedule.name, schedule.num_microbatches) in self._checked:
            return
        owner = schedule.process_of()
        sends: dict[tuple[int, int], list[Action]] = defaultdict(list)
        recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
        for actions in schedule.programs():
            for a in actions:
                if a.kind in SENDS:
                    sends[(owner[a.stage], owner[a.peer().stage])].append(a.peer())
                elif a.kind in RECVS:
                    recvs[(owner[a.peer().stage], owner[a.stage])].append(a)
        for link, order in sends.items():
            if order != recvs[link]:
                raise ScheduleError(f"schedule {schedule.name!r}: process {link[0]} sends to process "
                                    f"{link[1]} in a different order than it receives; NCCL would "
                                    "mismatch the messages")
        self._checked.add((schedule.name, schedule.num_microbatches))
