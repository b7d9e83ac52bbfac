"""The schedule ablation: throughput beside peak memory per device, for every schedule, one model.

For K devices and M micro-batches, each schedule of :data:`gpipe_repro.engine.schedule.SCHEDULES` is
planned (:class:`~gpipe_repro.memory.planner.MemoryPlanner`: each device's peak, replaying the
schedule's own actions) and simulated (:func:`gpipe_repro.sim.simulator.simulate` over FLOP-model
costs at a fixed device rate, the same cost model as :mod:`gpipe_repro.memory.autoplan`), on the
same cut where the schedule allows it. All numbers are simulated.

Interleaved 1F1B runs v=2 cells per device, so it is planned on 2K cells (cut by the planner's own
memory-balanced candidates) and a device's peak is the SUM of its two cells' peaks: an upper bound
(the two cells' peaks need not coincide), labelled as such in each row.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpipe_repro.engine.schedule import SCHEDULES, make_schedule
from gpipe_repro.memory.autoplan import _costs
from gpipe_repro.memory.planner import MemoryPlanner
from gpipe_repro.sim.links import LinkModel
from gpipe_repro.sim.simulator import simulate

VIRTUAL_STAGES = 2   # interleaved: cells per device (engine.schedule.interleaved_schedule's default)


def schedule_ablation(planner: MemoryPlanner, *, devices: int, micro_batches: int, link: LinkModel,
                      flops_per_second: float, checkpoint: str = "never",
                      schedules: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One row per schedule: simulated step time and throughput, bubble, each device's peak memory
    and peak activation memory (bytes). Schedules that cannot serve (K, M) (e.g. interleaved with M
    not a multiple of K, or fewer layers than cells) get a row with ``note`` saying why."""
    rows = []
    for name in schedules or sorted(SCHEDULES):
        cells = devices * VIRTUAL_STAGES if name == "interleaved" else devices
        row: dict[str, Any] = {"schedule": name, "devices": devices, "cells": cells,
                               "micro_batches": micro_batches, "checkpoint": checkpoint,
                               "method": "simulated"}
        try:
            sched = make_schedule(name, cells, micro_batches, checkpoint)
            plan = planner.plan(cells, micro_batches, checkpoint, schedule=name)
        except ValueError as e:
            row["note"] = str(e)
            rows.append(row)
            continue
        sim = simulate(sched, _costs(planner, plan.balance, micro_batches, flops_per_second), link,
                       planner.batch)
        owner = sched.process_of()
        peak = [0] * devices
        activation = [0] * devices
        for s in plan.stages:
            peak[owner[s.stage]] += s.peak
            activation[owner[s.stage]] += s.activation_peak
        row.update({"balance": plan.balance, "step_time_s": sim.step_time, "throughput": sim.throughput,
                    "bubble": sim.bubble_fraction, "peak_bytes_per_device": peak,
                    "activation_peak_bytes_per_device": activation,
                    "max_peak_bytes": max(peak), "max_activation_peak_bytes": max(activation),
                    "memory_note": ("sum of the device's 2 cells' peaks (an upper bound)"
                                    if cells != devices else "the planner's peak")})
        rows.append(row)
    return rows


__all__ = ["schedule_ablation"]
