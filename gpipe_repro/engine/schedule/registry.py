"""The schedules by name: what ``GPipe(schedule=...)``, the CLI, the simulator and the planner ask for."""
from __future__ import annotations

from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.schedule.core import Schedule
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

__all__ = ["SCHEDULES", "make_schedule", "num_processes"]

SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule, "zb-h1": zero_bubble_h1_schedule,
             "interleaved": interleaved_schedule}


def make_schedule(name: str, num_stages: int, num_microbatches: int, checkpoint: str,
                  recompute_ahead: bool = False) -> Schedule:
    """Build a training schedule by name (the one entry point runtimes and tools use)."""
    require_one_of("schedule", name, SCHEDULES)
    return SCHEDULES[name](num_stages, num_microbatches, checkpoint, recompute_ahead)


def num_processes(name: str, num_stages: int) -> int:
    """How many processes :func:`make_schedule`'s `name` schedule of `num_stages` stages runs on:
    num_stages / v for "interleaved" (v = :data:`INTERLEAVED_VIRTUAL_STAGES`), else one per stage.
    Raises ValueError (saying what to use) for a stage count the schedule cannot serve."""
    if name == "interleaved":
        _check_interleaved_stages(num_stages, INTERLEAVED_VIRTUAL_STAGES)
        return num_stages // INTERLEAVED_VIRTUAL_STAGES
    return num_stages
