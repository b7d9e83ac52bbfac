"""The schedules by name: what ``GPipe(schedule=...)``, the CLI, the simulator and the planner ask for."""
from __future__ import annotations

import numbers

from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.schedule.core import Schedule
from gpipe_repro.engine.schedule.dualpipe_v import dualpipe_v_schedule
from gpipe_repro.engine.schedule.generators import (
    gpipe_schedule,
    one_f_one_b_schedule,
    zero_bubble_h1_schedule,
)
from gpipe_repro.engine.schedule.interleaved import (
    INTERLEAVED_VIRTUAL_STAGES,
    _check_interleaved_stages,
    interleaved_schedule,
)
from gpipe_repro.engine.schedule.partial_split import split_last
from gpipe_repro.engine.schedule.zero_bubble_v import check_v_stages, zero_bubble_v_schedule

__all__ = ["SCHEDULES", "V_SCHEDULES", "SPLIT_SCHEDULES", "make_schedule", "check_split_backwards",
           "num_processes", "cells_per_process",
           "owner_of_cells"]

SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule, "zb-h1": zero_bubble_h1_schedule,
             "interleaved": interleaved_schedule, "zb-v": zero_bubble_v_schedule,
             "dualpipe-v": dualpipe_v_schedule}
# The schedules placing 2K cells in a V on K processes: process p holds cells p and 2K-1-p.
V_SCHEDULES = ("zb-v", "dualpipe-v")


#: The schedules that split backwards into input and weight gradients (zero bubble): what
#: ``split_backwards`` applies to.
SPLIT_SCHEDULES = ("zb-h1", "zb-v", "dualpipe-v")


def make_schedule(name: str, num_stages: int, num_microbatches: int, checkpoint: str,
                  recompute_ahead: bool = False, split_backwards: int | None = None) -> Schedule:
    """Build a training schedule by name (the one entry point runtimes and tools use).
    `split_backwards`: for the zero-bubble schedules (:data:`SPLIT_SCHEDULES`), how many of the last
    micro-batches split their backward (:func:`~gpipe_repro.engine.schedule.partial_split.split_last`);
    None splits every one, as the paper does."""
    require_one_of("schedule", name, SCHEDULES)
    check_split_backwards(name, split_backwards)
    schedule = SCHEDULES[name](num_stages, num_microbatches, checkpoint, recompute_ahead)
    return schedule if split_backwards is None else split_last(schedule, int(split_backwards))


def check_split_backwards(name: str, split_backwards: int | str | None) -> None:
    """Raise ValueError, saying what to change, for a `split_backwards` the schedule `name` cannot
    take (a schedule that runs whole backwards; not an integer >= 0). The upper bound, M, is
    :func:`split_last`'s."""
    if split_backwards is None:
        return
    if name not in SPLIT_SCHEDULES:
        raise ValueError(f"split_backwards={split_backwards!r} is for the zero-bubble schedules "
                         f"({', '.join(SPLIT_SCHEDULES)}), which split backwards into input and "
                         f"weight gradients; schedule={name!r} runs whole backwards: leave "
                         "split_backwards out")
    if isinstance(split_backwards, bool) or not isinstance(split_backwards, numbers.Integral) \
            or split_backwards < 0:
        raise ValueError("split_backwards must be an integer from 0 to M (how many of the last "
                         f"micro-batches split their backward), got {split_backwards!r}")


def cells_per_process(name: str) -> int:
    """How many cells (stages) each process of a `name` schedule holds: v for "interleaved", 2 for
    the V schedules ("zb-v", "dualpipe-v"), else 1. K processes run K * cells_per_process(name)
    cells."""
    require_one_of("schedule", name, SCHEDULES)
    if name == "interleaved":
        return INTERLEAVED_VIRTUAL_STAGES
    return 2 if name in V_SCHEDULES else 1


def owner_of_cells(name: str, num_stages: int) -> list[int]:
    """The process running each of the `num_stages` cells of a `name` schedule (round robin for
    "interleaved", a V for "zb-v" and "dualpipe-v", one each otherwise). The placement does not
    depend on the number of micro-batches; it is read from a schedule of `num_stages` of them,
    a number every schedule serves."""
    procs = num_processes(name, num_stages)
    if procs == num_stages:
        return list(range(num_stages))
    return make_schedule(name, num_stages, num_stages, "never").process_of()


def num_processes(name: str, num_stages: int) -> int:
    """How many processes :func:`make_schedule`'s `name` schedule of `num_stages` stages runs on:
    num_stages / v for "interleaved" (v = :data:`INTERLEAVED_VIRTUAL_STAGES`), num_stages / 2 for
    the V schedules (two chunks per process), else one per stage. Raises ValueError (saying what to
    use) for a stage count the schedule cannot serve."""
    if name == "interleaved":
        _check_interleaved_stages(num_stages, INTERLEAVED_VIRTUAL_STAGES)
        return num_stages // INTERLEAVED_VIRTUAL_STAGES
    if name in V_SCHEDULES:
        check_v_stages(num_stages, name)
        return num_stages // 2
    return num_stages
