"""The simulator against real runs: the same configurations simulated and measured."""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from gpipe_repro.engine.schedule import make_schedule
from gpipe_repro.report.host import conditions, usable_cores, wait_for_idle
from gpipe_repro.repro.throughput.measure import MeasureFn
from gpipe_repro.repro.throughput.settings import MODELS, SweepSettings
from gpipe_repro.repro.throughput.workloads import PAPER_WORKLOADS, SCALED_WORKLOADS
from gpipe_repro.sim.calibration import calibrate
from gpipe_repro.sim.partition_choice import choose_partition
from gpipe_repro.sim.platform import platform_for
from gpipe_repro.sim.simulator import replay_costs, simulate

VALIDATION_MS = (1, 2, 4, 8, 16)
VALIDATION_CHECKPOINTS = ("always", "never")
VALIDATION_TARGETS = {"median": 0.05, "max": 0.10}


VALIDATION_KS = (2, 4, 8)


def validation_ks(cores: int) -> list[int]:
    """The K values of the tables (2, 4, 8) that real stage processes can run here, one core each:
    every K <= `cores`. A bigger host validates K=4 and K=8 with no change."""
    return [k for k in VALIDATION_KS if k <= cores]


def unvalidated_note(ks: Sequence[int], cores: int) -> str:
    """Why the K values of the tables above the largest validated one are not validated here."""
    missing = [k for k in VALIDATION_KS if k not in ks]
    if not missing:
        return ""
    return (f"**K = {', '.join(map(str, missing))} not validated here.** A measured K-stage pipeline "
            f"needs K stage processes computing at once, one per core; this host has {cores} usable "
            f"core(s), so K > {cores} would time-share cores and measure the operating system's "
            "scheduling, not the pipeline. Those configurations are simulated only. `make "
            f"validate-sim` takes every K <= usable cores, so a host with >= {max(missing)} cores "
            "validates them with no change.")


def validate_simulator(settings: SweepSettings, measure: MeasureFn, *,
                       models: Sequence[str] = MODELS, ks: Sequence[int] | None = None,
                       ms: Sequence[int] = VALIDATION_MS,
                       checkpoints: Sequence[str] = VALIDATION_CHECKPOINTS,
                       fresh_calibration: bool = True,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Simulate and measure the same configurations; relative error of simulated throughput.

    The costs are calibrated afresh (not read from the cache) by default, so that calibration and
    measurement see the machine in the same state."""
    say = progress or (lambda msg: None)
    platform = platform_for(settings.link)
    ks = list(ks) if ks is not None else validation_ks(usable_cores())
    if not ks:
        raise ValueError("validation needs at least 2 usable cores (one stage process per core)")
    workloads = PAPER_WORKLOADS if settings.paper_size else SCALED_WORKLOADS
    rows, timelines = [], {}
    for model in models:
        b = dict(settings.microbatch)[model]
        if settings.wait_idle > 0:
            say("waiting for an idle host to calibrate")
            wait_for_idle(settings.wait_idle)
        calib = calibrate(workloads[model], [b], method="time", device=settings.device,
                          threads=settings.threads, repeats=settings.repeats, progress=say,
                          use_cache=not fresh_calibration,
                          neighbours=settings.busy_neighbours(), rounds=settings.calibration_rounds)
        for checkpoint in checkpoints:
            for k in ks:
                balance = choose_partition(calib.partition_costs(b, checkpoint), k, settings.objective,
                                           measured=calib.method == "time")
                for m in ms:
                    say(f"validating {model} K={k} M={m} checkpoint={checkpoint}")
                    sim = platform.simulate(calib, balance, m, m * b, settings, checkpoint)
                    if settings.wait_idle > 0:
                        wait_for_idle(settings.wait_idle)
                    host = conditions()
                    idle, load = host["idle_fraction_before"], host["load_average_before"]
                    measured = measure(workloads[model], balance, m, m * b, checkpoint)
                    meas_tp = m * b / measured["step_time_s"]
                    replay = None
                    if measured.get("timeline") is not None:
                        replay = simulate(
                            make_schedule(settings.schedule, k, m, checkpoint,
                                          settings.recompute_ahead),
                            replay_costs(measured["timeline"], measured["step_time_s"],
                                         [calib.at(b)[sum(balance[:s + 1]) - 1].output_bytes
                                          for s in range(k - 1)]),
                            platform.link, m * b)
                    rows.append({"model": model, "K": k, "M": m, "checkpoint": checkpoint,
                                 "balance": balance, "microbatch": b, "batch": m * b,
                                 "simulated_step_s": sim.step_time,
                                 "measured_step_s": measured["step_time_s"],
                                 "measured_step_times_s": measured.get("step_times"),
                                 "simulated_throughput": sim.throughput,
                                 "measured_throughput": meas_tp,
                                 "relative_error": sim.throughput / meas_tp - 1.0,
                                 "load_average": [load, os.getloadavg()[0]],
                                 "host_idle_before": idle,
                                 "replay_step_s": replay.step_time if replay else None,
                                 "replay_error": (replay.throughput / meas_tp - 1.0
                                                  if replay else None),
                                 "simulated_breakdown": sim.breakdown,
                                 "measured_breakdown": (measured["timeline"].breakdown()
                                                        if measured.get("timeline") else None)})
                    if measured.get("timeline") is not None:
                        timelines[f"{model}_K{k}_M{m}_{checkpoint}"] = {
                            "measured": measured["timeline"].to_json(),
                            "simulated": sim.timeline.to_json()}
    errors = [abs(r["relative_error"]) for r in rows]
    replays = [abs(r["replay_error"]) for r in rows if r["replay_error"] is not None]
    summary = {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
               "replay_median_abs_error": statistics.median(replays) if replays else None,
               "replay_max_abs_error": max(replays) if replays else None,
               "load_average": [min(r["load_average"][0] for r in rows),
                                max(r["load_average"][1] for r in rows)],
               "targets": VALIDATION_TARGETS,
               "met": (statistics.median(errors) <= VALIDATION_TARGETS["median"]
                       and max(errors) <= VALIDATION_TARGETS["max"])}
    return {"settings": asdict(settings), "link": platform.to_json(), "rows": rows,
            "summary": summary, "timelines": timelines}
