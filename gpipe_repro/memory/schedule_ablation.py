"""The schedule ablation: throughput beside peak memory per device, for every schedule, one model.

For K devices and M micro-batches, each schedule of :data:`gpipe_repro.engine.schedule.SCHEDULES` is
planned (:class:`~gpipe_repro.memory.planner.MemoryPlanner`: each device's peak, replaying the
schedule's own actions) and simulated (:func:`gpipe_repro.sim.simulator.simulate`), on the same cut
where the schedule allows it. All numbers are simulated.

By default the step is simulated over FLOP-model costs at a fixed device rate (the same cost model as
:mod:`gpipe_repro.memory.autoplan`) on the planner's memory-balanced cut. A caller with other costs
(e.g. per-layer costs calibrated on a device, as ``make throughput-table`` does) passes ``cut`` and
``simulate_step``; the memory side is the planner's either way.

Interleaved 1F1B (v=2) and ZB-V run two cells per device, so they are planned on 2K cells and a
device's peak is its two cells' actions walked together in the order its process runs them
(:func:`gpipe_repro.memory.compose.walk_device`), labelled as such in each row.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gpipe_repro.engine.schedule import SCHEDULES, Schedule, cells_per_process, make_schedule
from gpipe_repro.memory.autoplan import simulate_step as planned_step
from gpipe_repro.memory.planner import MemoryPlanner
from gpipe_repro.sim.links import LinkModel
from gpipe_repro.sim.simulator import Simulation

#: ``cut(schedule)``: layers per cell for that schedule (its cells: ``schedule.num_stages``).
CutFn = Callable[[Schedule], Sequence[int]]
#: ``simulate_step(schedule, balance)``: one simulated step of that schedule on that cut.
StepFn = Callable[[Schedule, Sequence[int]], Simulation]


def schedule_ablation(planner: MemoryPlanner, *, devices: int, micro_batches: int,
                      link: LinkModel | None = None, flops_per_second: float | None = None,
                      checkpoint: str = "never", schedules: Sequence[str] | None = None,
                      cut: CutFn | None = None, simulate_step: StepFn | None = None,
                      ) -> list[dict[str, Any]]:
    """One row per schedule: simulated step time and throughput, bubble, each device's peak memory
    and peak activation memory (bytes). Schedules that cannot serve (K, M) (e.g. interleaved with M
    not a multiple of K, or fewer layers than cells) get a row with ``note`` saying why.

    The step is simulated by ``simulate_step(schedule, balance)`` if given, else over FLOP-model
    costs at ``flops_per_second`` across ``link`` (both then required). The cut is
    ``cut(schedule)`` if given, else the planner's memory-balanced one."""
    if simulate_step is None and (link is None or flops_per_second is None):
        raise ValueError("schedule_ablation needs link= and flops_per_second= (the FLOP model), or "
                         "simulate_step= (your own costs)")
    names = list(schedules or sorted(SCHEDULES))
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedule(s) {unknown}; choose from {sorted(SCHEDULES)}")
    rows = []
    for name in names:
        cells = devices * cells_per_process(name)
        row: dict[str, Any] = {"schedule": name, "devices": devices, "cells": cells,
                               "micro_batches": micro_batches, "checkpoint": checkpoint,
                               "method": "simulated"}
        try:
            sched = make_schedule(name, cells, micro_batches, checkpoint)
            balance = list(cut(sched)) if cut is not None else None
            plan = planner.plan(cells, micro_batches, checkpoint, balance=balance, schedule=name)
        except ValueError as e:
            row["note"] = str(e)
            rows.append(row)
            continue
        if simulate_step is not None:
            sim = simulate_step(sched, plan.balance)
        else:
            assert link is not None and flops_per_second is not None
            sim = planned_step(planner, sched, plan.balance, micro_batches, flops_per_second, link)
        peak = plan.device_peaks
        activation = [s.activation_peak for s in plan.devices or plan.stages]   # one per device
        row.update({"balance": plan.balance, "step_time_s": sim.step_time, "throughput": sim.throughput,
                    "bubble": sim.bubble_fraction, "peak_bytes_per_device": peak,
                    "activation_peak_bytes_per_device": activation,
                    "max_peak_bytes": max(peak), "max_activation_peak_bytes": max(activation),
                    "memory_note": ("the device's 2 cells walked together"
                                    if cells != devices else "the planner's peak")})
        rows.append(row)
    return rows


__all__ = ["CutFn", "StepFn", "schedule_ablation"]
