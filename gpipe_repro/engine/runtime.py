"""What a runtime is: who runs the stage executors of one pipeline, and how.

:class:`~gpipe_repro.engine.gpipe.GPipe` splits mini-batches, builds schedules and keeps the
training state (step, seed, loss scale); a :class:`Runtime` executes a schedule over the stage
executors it holds and returns what the stages agreed on. Two implement it:

- :class:`~gpipe_repro.engine.local_runtime.LocalRuntime`: every stage in this process;
- ``gpipe_repro.distributed.runtime.DistributedRuntime``: this process's stages, the others in
  other processes (loaded by :mod:`gpipe_repro.engine.placement` when asked for).

Both run the one driver loop (:mod:`gpipe_repro.engine.driver`) over the same
:class:`~gpipe_repro.engine.stage.StageExecutor`; they differ in the transport between stages and in
what a barrier is.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from gpipe_repro.engine.agreement import Agreement, StepConfig
from gpipe_repro.engine.local_runtime import LocalRuntime
from gpipe_repro.engine.placement import Placement
from gpipe_repro.engine.schedule import Schedule
from gpipe_repro.engine.stage import StageExecutor
from gpipe_repro.engine.tied import Tie
from gpipe_repro.engine.timeline import Timeline

__all__ = ["Runtime", "build_runtime"]


class Runtime(Protocol):
    """Runs a pipeline's schedules over the stage executors of this process.

    Attributes:
        executors: this process's stage executors, by stage.
        record: record a timeline of the next steps' actions (:attr:`last_timeline`).
        last_timeline: the last recorded step's or forward's timeline (every stage's), or None.
    """
    executors: list[StageExecutor]
    record: bool
    last_timeline: Timeline | None

    def check_same_batch(self, key: Any, call: str = "train_step") -> None:
        """Before any work: raise ValueError unless every process is in the same `call` (one of
        CALLS) and was given the same batch (`key` describes it); nothing to check in one process."""
        ...

    def any_process(self, flags: Sequence[bool]) -> list[bool]:
        """Each of `flags` true where it is true in any process of the job (what each process reads
        off the cells it runs, such as their modes, made one answer for all)."""
        ...

    def train_step(self, schedule: Schedule, step: int, microbatches: list[Any], targets: list[Any],
                   weights: list[float | torch.Tensor], config: StepConfig) -> Agreement:
        """Run one training step of `schedule` (this process's share of it); return what the stages
        agreed on. All-or-nothing: if it raises, no cell was updated."""
        ...

    def forward(self, schedule: Schedule, step: int, microbatches: list[Any], config: StepConfig) -> Any:
        """Run an inference schedule; return the joined output of every micro-batch."""
        ...

    def move_to(self, devices: Sequence[torch.device]) -> None:
        """The cells were moved: stage s is on ``devices[s]`` from now on."""
        ...

    def reseed(self, seed: int) -> None:
        """Draw dropout masks from `seed` from now on (a resumed run's)."""
        ...


def build_runtime(placement: Placement, executors: list[StageExecutor], devices: list[torch.device],
                  ties: Sequence[Tie], *, replicas: int, bucket_cap_mb: float,
                  batchnorm_stats: str) -> Runtime:
    """The runtime `placement` asks for, running `executors` (this process's, by stage) on `devices`
    (one per stage); `ties`, `replicas`, `bucket_cap_mb`, `batchnorm_stats`: GPipe's."""
    if placement.plugin is None:
        return LocalRuntime(executors, devices, ties)
    runtime: Runtime = placement.plugin.DistributedRuntime(
        executors, placement.context, layout=placement.plugin.Layout(placement.processes, replicas),
        process_of=placement.process_of, bucket_cap_mb=float(bucket_cap_mb),
        batchnorm_stats=batchnorm_stats, ties=ties)
    return runtime
