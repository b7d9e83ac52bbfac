"""The simulator against real runs: the same configurations simulated and measured."""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

from gpipe_repro.engine.schedule import cells_per_process, make_schedule, num_processes
from gpipe_repro.models.workload import Workload
from gpipe_repro.report.host import fast_share, usable_cores
from gpipe_repro.repro.throughput.measure import MeasureFn
from gpipe_repro.repro.throughput.settings import MODELS, SweepSettings
from gpipe_repro.repro.throughput.simulator_error import TARGETS, error_figure, summarize_errors
from gpipe_repro.repro.throughput.workloads import PAPER_WORKLOADS, SCALED_WORKLOADS
from gpipe_repro.sim.calibration import Calibration, calibrate
from gpipe_repro.sim.partition_choice import choose_partition
from gpipe_repro.sim.platform import Platform, platform_for
from gpipe_repro.sim.simulator import replay_costs, simulate

VALIDATION_MS = (1, 2, 4, 8, 16)
VALIDATION_CHECKPOINTS = ("always", "never")
VALIDATION_TARGETS = TARGETS
#: Schedules validated against real runs. Interleaved 1F1B runs K processes of v = 2 cells each: its
#: cut has K*v cells, and its measured timeline has a row per process, so it is not replayed (the
#: replay reads each cell's action durations).
VALIDATION_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved", "zb-v")
NOT_VALIDATED: dict[str, str] = {}


VALIDATION_KS = (2, 4, 8)


def validation_ks(cores: int) -> list[int]:
    """The K values of the tables (2, 4, 8) that real stage processes can run here, one core each:
    every K <= `cores`. A bigger host validates K=4 and K=8 with no change."""
    return [k for k in VALIDATION_KS if k <= cores]


def unvalidated_note(ks: Sequence[int], cores: int) -> str:
    """Why the tables' K values missing from `ks` are not validated here: more stage processes than
    cores, or not asked for (a run restricted to some K)."""
    missing = [k for k in VALIDATION_KS if k not in ks]
    if not missing:
        return ""
    over = [k for k in missing if k > cores]
    asked = [k for k in missing if k <= cores]
    notes = []
    if over:
        notes.append(f"**K = {', '.join(map(str, over))} not validated here.** A measured K-stage pipeline "
                     f"needs K stage processes computing at once, one per core; this host has {cores} "
                     f"usable core(s), so K > {cores} would time-share cores and measure the operating "
                     "system's scheduling, not the pipeline. Those configurations are simulated only. "
                     f"`make validate-sim` takes every K <= usable cores, so a host with >= {max(over)} "
                     "cores validates them with no change.")
    if asked:
        notes.append(f"**K = {', '.join(map(str, asked))} not run in this validation** (it was asked for "
                     f"K = {', '.join(map(str, ks))} only); this host's {cores} cores could run them.")
    return "\n\n".join(notes)


def _per_schedule(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One schedule's error summary (:func:`summarize_errors`)."""
    return summarize_errors([r["error"] for r in rows])


def _validate_cut(model: str, workload: Workload, calib: Calibration, settings: SweepSettings,
                  measure: MeasureFn, platform: Platform, balance: list[int], b: int,
                  ms: Sequence[int], checkpoint: str, say: Callable[[str], None],
                  timelines: dict[str, Any]) -> list[dict[str, Any]]:
    """Every M of one (model, cut, checkpoint, settings.schedule): simulated, measured, replayed.
    `balance` has a cell per stage: K*v cells on K processes for interleaved."""
    cells = len(balance)
    k = num_processes(settings.schedule, cells)
    suffix = "" if settings.schedule == "gpipe" else f"_{settings.schedule}"
    rows: list[dict[str, Any]] = []
    for m in ms:
        if settings.schedule == "interleaved" and m % k:
            continue        # interleaved 1F1B takes micro-batches in groups of the K processes
        say(f"validating {model} K={k} M={m} checkpoint={checkpoint} "
            f"schedule={settings.schedule}")
        sim = platform.simulate(calib, balance, m, m * b, settings, checkpoint)
        # the probe is looked up at call time, so tests can give a fixed answer
        fast_before = fast_share()
        measured = measure(workload, balance, m, m * b, checkpoint)
        host_fast = (fast_before + fast_share()) / 2
        error = error_figure(measured.get("step_times") or [measured["step_time_s"]], sim.step_time,
                             host_fast)
        meas_tp = m * b / measured["step_time_s"]
        replay = None
        if measured.get("timeline") is not None and measured["timeline"].num_stages == cells:
            replay = simulate(
                make_schedule(settings.schedule, cells, m, checkpoint,
                              settings.recompute_ahead),
                replay_costs(measured["timeline"], measured["step_time_s"],
                             [calib.at(b)[sum(balance[:s + 1]) - 1].output_bytes
                              for s in range(cells - 1)]),
                platform.link, m * b)
        rows.append({"model": model, "K": k, "cells": cells, "M": m, "checkpoint": checkpoint,
                     "schedule": settings.schedule,
                     "balance": balance, "microbatch": b, "batch": m * b,
                     "simulated_step_s": sim.step_time,
                     "measured_step_s": measured["step_time_s"],
                     "measured_step_times_s": measured.get("step_times"),
                     "simulated_throughput": sim.throughput,
                     "measured_throughput": meas_tp,
                     "relative_error": sim.throughput / meas_tp - 1.0,
                     "error": error.to_json(), "host_fast": host_fast,
                     "replay_step_s": replay.step_time if replay else None,
                     "replay_error": (replay.throughput / meas_tp - 1.0
                                      if replay else None),
                     "simulated_breakdown": sim.breakdown,
                     "measured_breakdown": (measured["timeline"].breakdown()
                                            if measured.get("timeline") else None)})
        if measured.get("timeline") is not None:
            timelines[f"{model}_K{k}_M{m}_{checkpoint}" + suffix] = {
                "measured": measured["timeline"].to_json(),
                "simulated": sim.timeline.to_json()}
    return rows


def validate_simulator(settings: SweepSettings, measure: MeasureFn, *,
                       models: Sequence[str] = MODELS, ks: Sequence[int] | None = None,
                       ms: Sequence[int] = VALIDATION_MS,
                       checkpoints: Sequence[str] = VALIDATION_CHECKPOINTS,
                       fresh_calibration: bool = True,
                       schedules: Sequence[str] | None = None,
                       measure_schedule: Callable[[str], MeasureFn] | None = None,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Simulate and measure the same configurations; relative error of simulated throughput.

    Each schedule of `schedules` (default: ``settings.schedule`` only) is simulated and measured on
    the same cut, and the summary gives the error per schedule beside the overall one. `measure`
    runs ``settings.schedule``; ``measure_schedule(name)`` gives the MeasureFn of any other schedule
    (required when `schedules` names one). Interleaved is refused (:data:`NOT_VALIDATED`).

    The costs are calibrated afresh (not read from the cache) by default, so that calibration and
    measurement see the machine in the same state."""
    names = list(schedules) if schedules else [settings.schedule]
    refused = [n for n in names if n not in VALIDATION_SCHEDULES]
    if refused:
        raise ValueError(f"cannot validate {', '.join(refused)}: "
                         + "; ".join(NOT_VALIDATED.get(n, f"{n!r} is not a schedule of the "
                                                          "distributed runtime") for n in refused)
                         + f". Validate among {', '.join(VALIDATION_SCHEDULES)}")
    if measure_schedule is None and any(n != settings.schedule for n in names):
        raise ValueError(f"measure runs {settings.schedule!r} only: pass measure_schedule= to "
                         f"measure {', '.join(n for n in names if n != settings.schedule)}")
    measures = {n: (measure if n == settings.schedule or measure_schedule is None
                    else measure_schedule(n)) for n in names}
    say = progress or (lambda msg: None)
    platform = platform_for(settings.link)
    ks = list(ks) if ks is not None else validation_ks(usable_cores())
    if not ks:
        raise ValueError("validation needs at least 2 usable cores (one stage process per core)")
    workloads = PAPER_WORKLOADS if settings.paper_size else SCALED_WORKLOADS
    rows: list[dict[str, Any]] = []
    timelines: dict[str, Any] = {}
    for model in models:
        b = dict(settings.microbatch)[model]
        calib = calibrate(workloads[model], [b], method="time", device=settings.device,
                          threads=settings.threads, repeats=settings.repeats, progress=say,
                          use_cache=not fresh_calibration,
                          neighbours=settings.busy_neighbours(), rounds=settings.calibration_rounds,
                          max_rounds=settings.calibration_max_rounds)
        for checkpoint in checkpoints:
            for k in ks:
                for name in names:
                    cells = k * cells_per_process(name)
                    balance = choose_partition(calib.partition_costs(b, checkpoint), cells,
                                               settings.objective, calib.uncertainty_at(b))
                    rows += _validate_cut(model, workloads[model], calib, replace(settings, schedule=name),
                                          measures[name], platform, balance, b, ms, checkpoint, say,
                                          timelines)
    replays = [abs(r["replay_error"]) for r in rows if r["replay_error"] is not None]
    summary = {**summarize_errors([r["error"] for r in rows]),
               "replay_median_abs_error": statistics.median(replays) if replays else None,
               "replay_max_abs_error": max(replays) if replays else None,
               "host_fast": statistics.fmean(r["host_fast"] for r in rows) if rows else None,
               "per_schedule": {n: _per_schedule([r for r in rows if r["schedule"] == n])
                                for n in names},
               "not_validated": dict(NOT_VALIDATED)}
    return {"settings": asdict(settings), "link": platform.to_json(), "rows": rows,
            "summary": summary, "timelines": timelines}
