"""K x R processes: R replicas of a K-stage pipeline, and the process groups between them.

**Rank layout: ``rank = replica * K + stage``.** The K ranks of one pipeline are consecutive
(replica r is ranks ``r*K .. r*K + K - 1``); the data-parallel group of stage s is the R ranks
``s, s + K, s + 2K, ...``. Why this order and not the other:

- a pipeline's point-to-point messages are on its critical path 2(M + K - 1) times per step (every
  micro-batch's activation and gradient, in the fill and in the drain), while a stage's
  data-parallel all-reduce happens once per step and overlaps the drain (it starts when the stage's
  last backward is done). With consecutive ranks, ``torchrun --nproc-per-node K`` (or a multiple of
  K) puts each pipeline inside one host, where its many small latency-bound messages use the fast
  link (NVLink), and only the once-per-step all-reduce crosses hosts. This is the paper's own
  picture ("use K = 4 partitions and replicate this pipeline 8 times": a pipeline per group of
  accelerators);
- a replica's stages are then numbered like a single pipeline's (stage = rank mod K), so everything
  written for one pipeline (the schedule's ``stages[s]``, the transport's neighbours ``s +- 1``) holds
  with an offset of ``replica * K``.

(Megatron-LM orders pipeline ranks outermost instead, because its tensor-parallel and data-parallel
traffic is the larger; when the gradient all-reduce dominates, that order is the better one. It is
not offered here.)

Every group is created by every rank in the same order (``torch.distributed.new_group`` is
collective over the whole job), so :func:`build_groups` must be called by all K x R ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Layout", "Groups", "build_groups"]


@dataclass(frozen=True)
class Layout:
    """Where each of the K x R ranks sits: ``rank = replica * stages + stage``.

    Args:
        stages: K, the pipeline's number of stages.
        replicas: R, the number of pipeline replicas (data-parallel degree).
    """
    stages: int
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.stages < 1 or self.replicas < 1:
            raise ValueError(f"a layout needs stages >= 1 and replicas >= 1, got {self.stages} x "
                             f"{self.replicas}")

    @property
    def world_size(self) -> int:
        """K x R."""
        return self.stages * self.replicas

    def rank(self, *, replica: int, stage: int) -> int:
        """The global rank of `stage` of `replica`."""
        return replica * self.stages + stage

    def stage_of(self, rank: int) -> int:
        """The stage a global rank runs."""
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        """The replica a global rank belongs to."""
        return rank // self.stages

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The K ranks of one pipeline replica, in stage order."""
        return [self.rank(replica=replica, stage=s) for s in range(self.stages)]

    def data_parallel_ranks(self, stage: int) -> list[int]:
        """The R ranks that hold `stage` (one per replica), in replica order."""
        return [self.rank(replica=r, stage=stage) for r in range(self.replicas)]

    @staticmethod
    def for_world(world_size: int, stages: int, replicas: int) -> Layout:
        """The layout of a job of `world_size` processes; raises a ValueError saying what to change
        when the job does not have exactly K x R processes."""
        if world_size % stages != 0:
            raise ValueError(f"the job has {world_size} processes, which is not a multiple of "
                             f"partitions={stages}: start K x R processes (torchrun --nproc-per-node "
                             f"{stages} --nnodes R, or launch_local(fn, {stages} * R))")
        if world_size != stages * replicas:
            raise ValueError(f"partitions={stages} x replicas={replicas} needs {stages * replicas} "
                             f"processes but the job has {world_size}: start {stages * replicas} "
                             f"processes, or pass replicas={world_size // stages}")
        return Layout(stages, replicas)


@dataclass
class Groups:
    """This rank's process groups (None stands for the default group: the whole job).

    Attributes:
        layout: the job's layout; rank: this process's global rank.
        pipeline: the group of this rank's pipeline replica (its K stages).
        data_parallel: the group of this rank's stage across replicas (R ranks).
    """
    layout: Layout
    rank: int
    pipeline: dist.ProcessGroup | None
    data_parallel: dist.ProcessGroup | None

    @property
    def stage(self) -> int:
        """This rank's stage."""
        return self.layout.stage_of(self.rank)

    @property
    def replica(self) -> int:
        """This rank's replica."""
        return self.layout.replica_of(self.rank)


_built: dict[tuple[int, int, int], Groups] = {}


def build_groups(layout: Layout) -> Groups:
    """Create every pipeline group and every data-parallel group (collective: all ranks call it, in
    the same order) and return this rank's. With one replica no group is created (the pipeline is the
    whole job); with one stage the data-parallel group is the whole job.

    Built once per layout and process group, then reused: nothing frees a torch.distributed group
    before the job ends, so building them per pipeline would leak about 10 file descriptors and 6
    threads per pipeline built in a loop. Every rank builds its pipelines in the same order, so
    every rank reuses alike."""
    rank = dist.get_rank()
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"layout {layout.stages} x {layout.replicas} on a job of "
                         f"{dist.get_world_size()} processes")
    key = (id(dist.group.WORLD), layout.stages, layout.replicas)
    if key in _built:
        return _built[key]
    _built[key] = groups = _create(layout, rank)
    return groups


def _create(layout: Layout, rank: int) -> Groups:
    pipeline = data_parallel = None
    if layout.replicas > 1 and layout.stages > 1:
        for r in range(layout.replicas):
            g = dist.new_group(layout.pipeline_ranks(r))
            if r == layout.replica_of(rank):
                pipeline = g
        for s in range(layout.stages):
            g = dist.new_group(layout.data_parallel_ranks(s))
            if s == layout.stage_of(rank):
                data_parallel = g
    return Groups(layout, rank, pipeline, data_parallel)
