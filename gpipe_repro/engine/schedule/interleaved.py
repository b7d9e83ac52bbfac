"""Interleaved 1F1B (Narayanan et al., SC'21): the model in K*v cells, v per process round robin,
each process's program interleaving its cells' actions; and placing a forward-only schedule on
processes that hold several cells (:func:`forward_on_processes`)."""
from __future__ import annotations

from gpipe_repro.engine.schedule.actions import Action, ActionKind
from gpipe_repro.engine.schedule.core import Schedule
from gpipe_repro.engine.schedule.generators import (
    _backward_block,
    _check_sizes,
    _forward_block,
    checkpointed_microbatches,
)

__all__ = ["INTERLEAVED_VIRTUAL_STAGES", "interleaved_schedule", "forward_on_processes"]

INTERLEAVED_VIRTUAL_STAGES = 2   # v of make_schedule("interleaved", ...): cells per process


def _check_interleaved_stages(num_stages: int, v: int) -> None:
    if v < 1 or num_stages % v:
        raise ValueError(f"interleaved 1F1B cuts the model into K*v cells for K processes: "
                         f"{num_stages} stages (partitions) is not a multiple of v={v}; use "
                         f"partitions={max(v, num_stages - num_stages % v)}")


def interleaved_schedule(num_stages: int, num_microbatches: int, checkpoint: str = "never",
                         recompute_ahead: bool = False, *,
                         virtual_stages: int = INTERLEAVED_VIRTUAL_STAGES) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC'21, section 2.2.2): the model is cut into ``num_stages`` = K*v
    cells (stages) and process r runs stages r, r+K, ..., r+(v-1)K (round robin), so each process
    holds v smaller cells and the bubble shrinks v-fold, (K-1)/v units of a full cell per
    micro-batch instead of K-1, for v times more messages. The order is Megatron-LM's
    (``forward_backward_pipelining_with_interleaving``): forwards run K micro-batches through one
    cell, then the same K through the next; process r warms up with (K-r-1)*2 + (v-1)*K forwards,
    then alternates one forward and one backward. Like Megatron-LM it needs M a multiple of K.

    The schedule's stages are the K*v cells; :attr:`Schedule.processes` gives each process's program.
    Every checkpoint mode is allowed (a RECOMPUTE right before its BACKWARD, as in 1F1B)."""
    _check_sizes(num_stages, num_microbatches)
    v = virtual_stages
    _check_interleaved_stages(num_stages, v)
    k = num_stages // v
    if num_microbatches % k:
        raise ValueError(f"interleaved 1F1B needs the micro-batches in groups of the {k} processes "
                         f"(as Megatron-LM does): M={num_microbatches} is not a multiple of {k}; use "
                         f"M={num_microbatches + k - num_microbatches % k}")
    ckpt = checkpointed_microbatches(checkpoint, num_microbatches)
    A = ActionKind
    total = num_microbatches * v

    def chunk_mb(i: int, backward: bool) -> tuple[int, int]:
        chunk = (i // k) % v
        return (v - 1 - chunk if backward else chunk), (i // (k * v)) * k + i % k

    procs = []
    for r in range(k):
        warmup = min((k - r - 1) * 2 + (v - 1) * k, total)
        order = [(False, i) for i in range(warmup)]
        for i in range(total - warmup):
            order += [(False, warmup + i), (True, i)]
        order += [(True, i) for i in range(total - warmup, total)]
        acts: list[Action] = []
        for backward, i in order:
            chunk, mb = chunk_mb(i, backward)
            s = chunk * k + r
            acts += (_backward_block(s, num_stages, mb, ckpt, recompute_ahead) if backward
                     else _forward_block(s, num_stages, mb))
        acts += [Action(A.AGREE, c * k + r) for c in range(v)]
        acts += [Action(A.OPTIMIZER_STEP, c * k + r) for c in range(v)]
        procs.append(tuple(acts))
    stages = tuple(tuple(a for p in procs for a in p if a.stage == s) for s in range(num_stages))
    return Schedule("interleaved", num_stages, num_microbatches, stages, True, tuple(procs))


def forward_on_processes(schedule: Schedule, process_of: list[int]) -> Schedule:
    """A forward-only `schedule` run by processes holding several stages (``process_of[s]``, e.g. a
    training schedule's :meth:`Schedule.process_of`): each process runs its stages one after the
    other, in stage order. That cannot deadlock: a stage only waits on a lower stage, and every
    process runs its lower stages first. Training schedules place their own stages."""
    if schedule.training:
        raise ValueError("forward_on_processes places forward-only schedules; a training schedule "
                         "says its own process programs (Schedule.processes)")
    if len(process_of) != schedule.num_stages:
        raise ValueError(f"process_of names {len(process_of)} stages for a schedule of "
                         f"{schedule.num_stages}")
    procs = tuple(tuple(a for s in range(schedule.num_stages) if process_of[s] == p
                        for a in schedule.stages[s]) for p in range(max(process_of) + 1))
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.stages,
                    False, procs)
