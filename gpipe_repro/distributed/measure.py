"""Measure one pipeline configuration on K local stage processes: step times and a merged timeline.

This is the ground truth the pipeline simulator is validated against, and what the runtime benchmark
uses. Nothing is simulated: K processes (one per stage, `threads` intra-op threads each) train the
given layers with ``GPipe(..., runtime="distributed")`` for `warmup` + `steps` steps; the time of a
step is the slowest rank's wall time from entering ``train_step`` to having the loss (the step ends
with a broadcast, so the ranks agree to within microseconds).

::

    from gpipe_repro.distributed.measure import measure_pipeline
    m = measure_pipeline(layers, balance=[4, 4], micro_batches=8, batch=(x, y), checkpoint="never")
    m.median_step_time, m.timeline.breakdown()
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.timeline import Event, Timeline

LayersArg = Sequence[nn.Module] | Callable[[], Sequence[nn.Module]]


@dataclass
class PipelineMeasurement:
    """What :func:`measure_pipeline` measured (seconds)."""
    step_times: list[float]          # every measured step, after warm-up
    median_step_time: float
    timeline: Timeline               # the measured step whose time is closest to the median
    losses: list[float]              # every step's loss, warm-up included
    config: dict[str, Any] = field(default_factory=dict)
    timelines: list[Timeline] = field(default_factory=list)   # every measured step's timeline
    cpus: list[list[int]] = field(default_factory=list)       # per rank: the cores it may run on
    cpu_seconds: list[list[float]] = field(default_factory=list)  # per rank, per step: CPU time
    cpu_timelines: list[Timeline] = field(default_factory=list)  # per step: actions in thread CPU time


def sgd(params: Any) -> torch.optim.Optimizer:
    """The default optimizer (a module-level function, so it can be sent to the stage processes)."""
    return torch.optim.SGD(params, lr=0.01)


def measure_pipeline(layers: LayersArg, balance: Sequence[int], micro_batches: int,
                     batch: tuple[Any, Any], *, checkpoint: str = "never",
                     recompute_ahead: bool = False, schedule: str = "gpipe",
                     split_backwards: int | None = None,
                     loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                     optimizer: Callable[[Any], torch.optim.Optimizer] = sgd, steps: int = 5,
                     warmup: int = 2, threads: int = 1, timeout: float = 60.0,
                     prepost: bool = True) -> PipelineMeasurement:
    """Train `layers` cut as `balance` (K = len(balance) processes) on `batch` = (inputs, targets)
    with M = `micro_batches`; return the measured step times and the median step's timeline.

    `layers`: the modules, or a picklable zero-argument function building them (cheaper to send).
    `loss_fn` defaults to cross-entropy. Everything passed must be picklable (module-level functions).
    """
    from gpipe_repro.distributed.launcher import launch_local
    from gpipe_repro.engine.schedule import num_processes

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    config = {"balance": list(balance), "partitions": len(balance), "micro_batches": micro_batches,
              "checkpoint": checkpoint, "recompute_ahead": recompute_ahead, "schedule": schedule,
              "split_backwards": split_backwards, "steps": steps, "warmup": warmup, "threads": threads,
              "prepost": prepost,
              "batch_size": _batch_size(batch[0])}
    # one process per stage; interleaved: one per v cells (`balance` has a cell per stage)
    per_rank = launch_local(_measure_rank, num_processes(schedule, len(balance)), layers, config, batch,
                            loss_fn or nn.CrossEntropyLoss(), optimizer, timeout=timeout,
                            threads=threads)
    times = [max(rank[0][i] for rank in per_rank) for i in range(steps)]
    median = statistics.median(times)
    closest = min(range(steps), key=lambda i: abs(times[i] - median))
    for i, t in enumerate(per_rank[0][1]):
        t.meta.update({"step_time_s": times[i], **config,
                       "rank_cpus": [rank[3] for rank in per_rank],
                       "rank_cpu_seconds": [rank[4][i] for rank in per_rank]})
    cpu_timelines = [Timeline(len(balance), [e for rank in per_rank for e in rank[5][i]],
                              {"clock": "thread CPU time of each action"}) for i in range(steps)]
    return PipelineMeasurement(times, median, per_rank[0][1][closest], per_rank[0][2], config,
                               timelines=list(per_rank[0][1]), cpus=[rank[3] for rank in per_rank],
                               cpu_seconds=[rank[4] for rank in per_rank], cpu_timelines=cpu_timelines)


def _measure_rank(layers: LayersArg, config: dict[str, Any], batch: tuple[Any, Any],
                  loss_fn: Callable[[Any, Any], torch.Tensor],
                  optimizer: Callable[[Any], torch.optim.Optimizer]
                  ) -> tuple[list[float], list[Timeline], list[float], list[int], list[float],
                             list[list[Event]]]:
    from gpipe_repro.distributed.runtime import DistributedRuntime
    from gpipe_repro.engine.gpipe import GPipe

    built = layers() if callable(layers) else layers
    pipe = GPipe(built, partitions=config["partitions"], micro_batches=config["micro_batches"],
                 checkpoint=config["checkpoint"], balance=config["balance"], loss_fn=loss_fn,
                 optimizer=optimizer, schedule=config["schedule"],
                 recompute_ahead=config["recompute_ahead"], split_backwards=config["split_backwards"],
                 runtime="distributed")
    runtime = pipe.runtime
    assert isinstance(runtime, DistributedRuntime)
    runtime.transport.prepost = config["prepost"] and runtime.transport.prepost
    pipe.record_timeline = True
    inputs, targets = batch
    times: list[float] = []
    timelines: list[Timeline] = []
    losses: list[float] = []
    cpu: list[float] = []
    cpu_events: list[list[Event]] = []
    for i in range(config["warmup"] + config["steps"]):
        if i == config["warmup"]:
            settle_garbage_collector()
        sink: list[Event] = []
        for executor in runtime.executors:      # several cells per process: interleaved
            record_cpu_times(executor, sink)
        cpu0 = time.process_time()
        losses.append(pipe.train_step(inputs, targets))
        if i >= config["warmup"]:
            cpu.append(time.process_time() - cpu0)
            assert runtime.last_step_time is not None
            times.append(runtime.last_step_time)
            assert pipe.last_timeline is not None
            timelines.append(pipe.last_timeline)
            cpu_events.append(sink)
    return times, timelines, losses, _allowed_cpus(), cpu, cpu_events


def settle_garbage_collector() -> None:
    """Between the warm-up and the measured steps, on every rank: collect what start-up left and
    freeze what survives (the model, the optimizer's state, the transport's buffers) out of the
    garbage collector's sight. Otherwise the first steps after a short warm-up pay for full
    collections of that start-up heap, which a long training run pays once: a zb-v step of
    AmoebaNet-D (K=2, M=8) took 750-1000 ms on the two steps after two warm-up steps and 550-600 ms
    after them, and 540-575 ms throughout with the collector off. The measured steps still pay for
    collecting what they make themselves."""
    import gc
    gc.collect()
    gc.freeze()


def record_cpu_times(executor: Any, sink: list[Event]) -> None:
    """From now on, append to `sink` one Event per action `executor` runs, timed by the thread's CPU
    clock (time.thread_time) instead of the wall clock: what the action computed, without the time
    the OS gave the core to other processes. With one intra-op thread per stage (the measured runs'
    setting), that is the action's whole CPU cost."""
    run = type(executor).execute

    def execute(action: Any) -> None:
        c0 = time.thread_time()
        run(executor, action)
        sink.append(Event(executor.stage, action.kind.value, action.microbatch, c0, time.thread_time()))

    executor.execute = execute


def _allowed_cpus() -> list[int]:
    """The cores this process may run on (every core where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _batch_size(inputs: Any) -> int:
    from gpipe_repro.engine.microbatch import batch_size
    return batch_size(inputs)
