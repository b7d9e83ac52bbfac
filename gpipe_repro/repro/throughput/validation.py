"""The simulator against real runs: the same configurations simulated and measured."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from gpipe_repro.engine.schedule import SPLIT_SCHEDULES, cells_per_process, make_schedule, num_processes
from gpipe_repro.models.workload import Workload
from gpipe_repro.report.host import HostWatch, fast_share, usable_cores
from gpipe_repro.report.measurement import another_round, item_fits
from gpipe_repro.repro.throughput.measure import MeasureFn
from gpipe_repro.repro.throughput.settings import MODELS, SweepSettings
from gpipe_repro.repro.throughput.simulator_error import (
    TARGETS,
    error_by_host_state,
    error_figure,
    paired_error_figure,
    summarize_errors,
)
from gpipe_repro.repro.throughput.workloads import PAPER_WORKLOADS, SCALED_WORKLOADS
from gpipe_repro.sim.calibration import Calibration, calibrate
from gpipe_repro.sim.jitter import measure_jitter
from gpipe_repro.sim.partition_choice import choose_cut
from gpipe_repro.sim.platform import Platform, platform_for
from gpipe_repro.sim.simulator import replay_costs, simulate
from gpipe_repro.sim.split_choice import choose_split

VALIDATION_MS = (1, 2, 4, 8, 16)
VALIDATION_CHECKPOINTS = ("always", "never")
VALIDATION_TARGETS = TARGETS
#: Schedules validated against real runs (interleaved 1F1B and zb-v run K processes of v = 2 cells
#: each: their cut has K*v cells, and the replay reads each cell's action durations off the events'
#: cells).
VALIDATION_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved", "zb-v")
NOT_VALIDATED: dict[str, str] = {}


VALIDATION_KS = (2, 4, 8)


#: What a validation's numbers are (its JSON says it beside them).
METHOD = ("measured_*: steps measured on this host's real stage processes (one per core, gloo); "
          "simulated_*: the simulator from per-layer costs calibrated on this host, every compute "
          "action's duration drawn as durations vary in a pipeline here, the median of the drawn "
          "steps; exact_*: simulated with every action at its calibrated cost; replay_*: the "
          "simulator replaying each measured step's own action durations; error (and exact_error): "
          "each round's measured steps against the simulation from the costs calibrated in that "
          "round (simulated_step_per_round_s), paired; unpaired_error, simulated_step_s and "
          "relative_error: all the steps against the simulation from the median of the rounds' "
          "costs; host_fast*: the speed probe's share of fast readings on this host's cores "
          "(measured) around the runs and around the calibrations")


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


def zero_bubble_against_1f1b(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, checkpoint mode and M, each schedule that splits backwards (zb-h1, zb-v) against
    1F1B, both measured in every round: 1F1B's step time over its, step by step within each
    round (the measurement kernel's pairing), above 1 where zero bubble is faster. Each on its own
    cut (:func:`gpipe_repro.sim.partition_choice.choose_cut`; a zero-bubble one with its split
    count, :func:`gpipe_repro.sim.split_choice.choose_split`). Target (the schedules issue): the
    interval's lower bound >= 1."""
    from gpipe_repro.report.measurement import Figure

    by = {(r["model"], r.get("K"), r["checkpoint"], r["M"], r["schedule"]): r for r in rows}
    out = []
    for (model, k, checkpoint, m, name), r in by.items():
        base = by.get((model, k, checkpoint, m, "1f1b"))
        if base is None or name not in SPLIT_SCHEDULES:
            continue
        ours, theirs = r["measured_step_times_s"], base["measured_step_times_s"]
        n = min(len(ours), len(theirs))
        figure = Figure.of(f"{model} {checkpoint} M={m}: 1f1b / {name}",
                           [b / a for a, b in zip(ours[:n], theirs[:n])], target=1.0)
        out.append({"model": model, "K": k, "checkpoint": checkpoint, "M": m, "schedule": name,
                    "split_backwards": r.get("split_backwards"),
                    "balance": r["balance"], "balance_1f1b": base["balance"],
                    "ratio": figure.to_json()})
    return out


#: Levels a fresh calibration to the stage processes: (workload, calibration, micro-batch, K, link)
#: -> the leveled calibration and its factor per action kind (:func:`gpipe_repro.sim.in_situ.level`).
LevelFn = Callable[[Workload, Calibration, int, int, Any], tuple[Calibration, dict[str, float]]]


@dataclass
class _Config:
    """One validated configuration: what is measured, and its simulation."""

    model: str
    workload: Workload
    settings: SweepSettings
    measure: MeasureFn
    platform: Platform
    balance: list[int]
    b: int
    m: int
    checkpoint: str
    split_choice: dict[str, Any] | None = None   # a zero-bubble schedule's (choose_split)

    def describe(self) -> str:
        k = num_processes(self.settings.schedule, len(self.balance))
        split = ("" if self.settings.split_backwards is None
                 else f" split_backwards={self.settings.split_backwards}")
        return (f"{self.model} K={k} M={self.m} checkpoint={self.checkpoint} "
                f"schedule={self.settings.schedule}{split}")


def _plan_cut(model: str, workload: Workload, settings: SweepSettings, measure: MeasureFn,
              platform: Platform, balance: list[int], b: int, ms: Sequence[int],
              checkpoint: str) -> list[_Config]:
    """Every M of one (model, cut, checkpoint, settings.schedule). `balance` has a cell per stage:
    K*v cells on K processes for interleaved."""
    k = num_processes(settings.schedule, len(balance))
    return [_Config(model, workload, settings, measure, platform, balance, b, m, checkpoint)
            for m in ms
            # interleaved 1F1B takes micro-batches in groups of the K processes
            if not (settings.schedule == "interleaved" and m % k)]


def _measure_once(c: _Config) -> dict[str, Any]:
    """One measured run of `c`, with the host's fast share around it."""
    # the probe is looked up at call time, so tests can give a fixed answer
    fast_before = fast_share()
    with HostWatch(before=dict) as watch:   # other processes' CPU during it (no 1 s sample before)
        measured = c.measure(c.workload, c.balance, c.m, c.m * c.b, c.checkpoint)
    return {**measured, "host_fast": (fast_before + fast_share()) / 2,
            "others_cpu": watch.conditions.get("others_cpu_fraction_during")}


def _runs_as_one(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A configuration's measured runs (one per round) as one: every step of every run, their
    median, the timeline of the run whose median step is nearest to it, the mean fast share."""
    steps = [t for r in runs for t in (r.get("step_times") or [r["step_time_s"]])]
    median = statistics.median(steps)
    nearest = min(runs, key=lambda r: abs(r["step_time_s"] - median))
    return {"step_time_s": median, "step_times": steps, "timeline": nearest.get("timeline"),
            "host_fast": statistics.fmean(r["host_fast"] for r in runs), "rounds": len(runs),
            "others_cpu": [r.get("others_cpu") for r in runs]}


def _row(c: _Config, calibs: Sequence[Calibration], runs: Sequence[dict[str, Any]],
         timelines: dict[str, Any], leveled: Sequence[Calibration] = ()) -> dict[str, Any]:
    """`c`'s row from its measured `runs` (one per round) and its model's calibrations `calibs`
    (one per round, or one for them all): the error pairs each round's measured steps with the
    simulation from that round's calibration; the samples/s columns, the timeline and the replay
    come from the median of the calibrations against all the steps (:func:`_runs_as_one`)."""
    cells, m, b, settings = len(c.balance), c.m, c.b, c.settings
    measured = _runs_as_one(runs)

    def simulated(calib: Calibration) -> Any:
        return c.platform.simulate(calib, c.balance, m, m * b, settings, c.checkpoint)
    sim = simulated(Calibration.median_of(list(calibs)))
    per_round = [simulated(calibs[min(r, len(calibs) - 1)]) for r in range(len(runs))]
    steps = [run.get("step_times") or [run["step_time_s"]] for run in runs]
    error = paired_error_figure([(ts, s.step_time) for ts, s in zip(steps, per_round)],
                                measured["host_fast"])
    unpaired = error_figure(measured["step_times"], sim.step_time, measured["host_fast"])
    leveled_error = (paired_error_figure(
        [(ts, simulated(leveled[min(r, len(leveled) - 1)]).step_time) for r, ts in enumerate(steps)],
        measured["host_fast"]) if leveled else None)
    exact = (paired_error_figure([(ts, s.exact_step_time) for ts, s in zip(steps, per_round)])
             if all(s.exact_step_time for s in per_round) else None)
    k = num_processes(settings.schedule, cells)
    meas_tp = m * b / measured["step_time_s"]
    replay = None
    if (measured.get("timeline") is not None
            and 1 + max(e.schedule_stage for e in measured["timeline"].events) == cells):
        replay = simulate(
            make_schedule(settings.schedule, cells, m, c.checkpoint, settings.recompute_ahead,
                          settings.split_backwards),
            replay_costs(measured["timeline"], measured["step_time_s"],
                         [calibs[0].at(b)[sum(c.balance[:s + 1]) - 1].output_bytes
                          for s in range(cells - 1)]),
            c.platform.link, m * b)
    if measured.get("timeline") is not None:
        suffix = "" if settings.schedule == "gpipe" else f"_{settings.schedule}"
        timelines[f"{c.model}_K{k}_M{m}_{c.checkpoint}" + suffix] = {
            "measured": measured["timeline"].to_json(), "simulated": sim.timeline.to_json()}
    return {"model": c.model, "K": k, "cells": cells, "M": m, "checkpoint": c.checkpoint,
            "schedule": settings.schedule, "split_backwards": settings.split_backwards,
            "split_choice": c.split_choice,
            "balance": c.balance, "microbatch": b, "batch": m * b,
            "simulated_step_s": sim.step_time,
            "simulated_step_per_round_s": [s.step_time for s in per_round],
            "measured_step_s": measured["step_time_s"],
            "measured_step_times_s": measured["step_times"],
            "measured_rounds": measured["rounds"],
            "simulated_throughput": sim.throughput,
            "measured_throughput": meas_tp,
            "relative_error": sim.throughput / meas_tp - 1.0,
            "exact_step_s": sim.exact_step_time,
            "exact_error": exact.value if exact else None,
            "error": error.to_json(), "unpaired_error": unpaired.to_json(),
            "leveled_error": leveled_error.to_json() if leveled_error else None,
            "host_fast": measured["host_fast"],
            "others_cpu_per_round": measured.get("others_cpu"),
            "replay_step_s": replay.step_time if replay else None,
            "replay_error": (replay.throughput / meas_tp - 1.0 if replay else None),
            "simulated_breakdown": sim.breakdown,
            "measured_breakdown": (measured["timeline"].breakdown()
                                   if measured.get("timeline") else None)}


def validate_simulator(settings: SweepSettings, measure: MeasureFn, *,
                       models: Sequence[str] = MODELS, ks: Sequence[int] | None = None,
                       ms: Sequence[int] = VALIDATION_MS,
                       checkpoints: Sequence[str] = VALIDATION_CHECKPOINTS,
                       fresh_calibration: bool = True,
                       schedules: Sequence[str] | None = None,
                       measure_schedule: Callable[[SweepSettings], MeasureFn] | None = None,
                       choose_splits: bool = True,
                       progress: Callable[[str], None] | None = None,
                       rounds: int = 1, budget_s: float | None = None,
                       clock: Callable[[], float] | None = None,
                       level: LevelFn | None = None) -> dict[str, Any]:
    """Simulate and measure the same configurations; relative error of simulated throughput.

    Each schedule of `schedules` (default: ``settings.schedule`` only) is simulated and measured on
    the same cut, and the summary gives the error per schedule beside the overall one. `measure`
    runs `settings`; ``measure_schedule(s)`` gives the MeasureFn of other settings `s` (another
    schedule, or a zero-bubble schedule's split count): required when `schedules` names another
    schedule. With `choose_splits` (and `measure_schedule` to measure what it chooses, and no
    ``settings.split_backwards`` of the caller's) each zero-bubble configuration runs the cut and
    split count (``split_backwards``) its simulation from the first calibration gives the shortest
    step (:func:`gpipe_repro.sim.split_choice.choose_split`), per M; otherwise the settings' count
    (None: every backward split), on the cut of what the schedule runs.

    Every configuration is measured `rounds` times, once per round, the rounds alternating the order
    of the configurations (the measurement kernel's rule): its figure is the median over all its
    measured steps, and its interval spans the host's states over the whole validation instead of
    one burst of consecutive steps. The costs are calibrated afresh (not read from the cache) by
    default, once per round, each model right before its first configuration of the round: the cuts
    come from the first calibration, and each round's measured steps are compared with the
    simulation from that round's costs (a paired ratio per round, the measurement kernel's rule), so
    that the host's speed, which drifts over minutes on this host, moves both sides of each ratio
    (on a host whose speed drifts, a calibration in one burst before the measurements made 38 of 40
    errors one sign; the median of all rounds' costs against all the steps is kept beside it as
    ``unpaired_error``). With `budget_s`, a round after the second starts only where one more round
    of the mean length so far fits in it (:func:`another_round`), counted from the call, and a round
    after the first ends at the first configuration that would not end within it
    (:func:`item_fits`: its last run, and its model's calibration where it comes first).

    `level` (:func:`gpipe_repro.sim.in_situ.level`): each calibration is also leveled to the stage
    processes right after it is made (on the smallest K validated), and every row gets a
    ``leveled_error`` beside its error (paired per round in the same way); the summary's
    ``leveled`` gives their figure and ``level_factors`` the factors."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
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
    # a count chosen is measured through measure_schedule; a count the settings give is kept
    choose_splits = choose_splits and measure_schedule is not None and settings.split_backwards is None
    measures: dict[tuple[str, int | None], MeasureFn] = {}

    def measure_for(s: SweepSettings) -> MeasureFn:
        key = (s.schedule, s.split_backwards)
        if key not in measures:
            same = key == (settings.schedule, settings.split_backwards)
            measures[key] = measure if same or measure_schedule is None else measure_schedule(s)
        return measures[key]
    say = progress or (lambda msg: None)
    clock = clock or time.monotonic
    started = clock()
    # compared with this host's measured steps: its action durations drawn as they vary here, the
    # variation measured now with the costs (the host's phases last minutes), not read from the cache
    if fresh_calibration:
        measure_jitter(refresh=True)
    platform = platform_for(settings.link, jitter=True)
    ks = list(ks) if ks is not None else validation_ks(usable_cores())
    if not ks:
        raise ValueError("validation needs at least 2 usable cores (one stage process per core)")
    workloads = PAPER_WORKLOADS if settings.paper_size else SCALED_WORKLOADS
    timelines: dict[str, Any] = {}
    calibration_fast: list[float] = []   # the host's fast share around each calibration
    leveled: dict[str, list[Calibration]] = {m: [] for m in models}
    level_factors: dict[str, list[dict[str, float]]] = {m: [] for m in models}

    def calibrated(model: str) -> Calibration:
        before = fast_share()
        b = dict(settings.microbatch)[model]
        calib = calibrate(workloads[model], [b], method="time",
                          device=settings.device, threads=settings.threads, repeats=settings.repeats,
                          progress=say, use_cache=not fresh_calibration,
                          neighbours=settings.busy_neighbours(), rounds=settings.calibration_rounds,
                          max_rounds=settings.calibration_max_rounds)
        calibration_fast.append((before + fast_share()) / 2)
        if level is not None:
            say(f"leveling {model}'s calibration on the stage processes")
            scaled, factors = level(workloads[model], calib, b, min(ks), platform.link)
            leveled[model].append(scaled)
            level_factors[model].append(factors)
        return calib

    calibrations: dict[str, list[Calibration]] = {}
    calibrating: dict[str, float] = {}        # each model's last calibration, seconds
    for model in models:
        began = clock()
        calibrations[model] = [calibrated(model)]
        calibrating[model] = clock() - began
    configs: list[_Config] = []
    for model in models:
        b, calib = dict(settings.microbatch)[model], calibrations[model][0]
        for checkpoint in checkpoints:
            for k in ks:
                for name in names:
                    cells = k * cells_per_process(name)
                    if choose_splits and name in SPLIT_SCHEDULES:   # per M: its cut and split count
                        for m in ms:
                            choice = choose_split(calib, name, k, m, b, checkpoint, platform.link,
                                                  recompute_ahead=settings.recompute_ahead,
                                                  objective=settings.objective, setup=platform.setup,
                                                  teardown=platform.teardown)
                            chosen = replace(settings, schedule=name,
                                             split_backwards=choice.split_backwards)
                            configs += [replace(c, split_choice=choice.to_json()) for c in _plan_cut(
                                model, workloads[model], chosen, measure_for(chosen), platform,
                                choice.balance, b, [m], checkpoint)]
                        continue
                    # the cut of this schedule's cells (a zero-bubble one's split costs more)
                    balance = choose_cut(calib, b, checkpoint,
                                         make_schedule(name, cells, cells, checkpoint), settings.objective)
                    named = replace(settings, schedule=name)
                    configs += _plan_cut(model, workloads[model], named, measure_for(named), platform,
                                         balance, b, ms, checkpoint)
    # Every configuration once per round, in alternating order, and each model calibrated again in
    # every round but the first, right before its first configuration of the round: each round's
    # steps are compared with the costs of the same round, minutes apart at most, and over the rounds
    # both span the host's states over the whole validation.
    runs: list[list[dict[str, Any]]] = [[] for _ in configs]
    took: dict[int, float] = {}               # each configuration's last run, seconds
    r, cut_short = 0, False
    while not cut_short and another_round(r, rounds, clock() - started, budget_s):
        order = range(len(configs)) if r % 2 == 0 else range(len(configs) - 1, -1, -1)
        fresh: set[str] = set()
        for i in order:
            model = configs[i].model
            recalibrate = r > 0 and fresh_calibration and model not in fresh
            expected = took.get(i, 0.0) + (calibrating.get(model, 0.0) if recalibrate else 0.0)
            if r > 0 and not item_fits(clock() - started, expected, budget_s):
                say(f"round {r + 1} ends after {sum(len(x) > r for x in runs)} of {len(configs)} "
                    f"configurations: the next would not end within the {budget_s:g} s budget")
                cut_short = True
                break
            if recalibrate:
                began = clock()
                calibrations[model].append(calibrated(model))
                calibrating[model] = clock() - began
                fresh.add(model)
            say(f"validating {configs[i].describe()} (round {r + 1} of {rounds})")
            began = clock()
            runs[i].append(_measure_once(configs[i]))
            took[i] = clock() - began
        r += 1
    # The cuts stay those of the first calibration (the runs measured them).
    rows = [_row(c, calibrations[c.model], done, timelines, leveled[c.model])
            for c, done in zip(configs, runs)]
    replays = [abs(r["replay_error"]) for r in rows if r["replay_error"] is not None]
    exact = [abs(r["exact_error"]) for r in rows if r["exact_error"] is not None]
    summary = {**summarize_errors([r["error"] for r in rows]),
               "unpaired": summarize_errors([r["unpaired_error"] for r in rows]),
               "leveled": (summarize_errors([r["leveled_error"] for r in rows])
                           if level is not None and rows else None),
               "level_factors": level_factors if level is not None else None,
               "by_host_fast": error_by_host_state([r["error"]["value"] for r in rows],
                                                   [r["host_fast"] for r in rows]),
               "exact_median_abs_error": statistics.median(exact) if exact else None,
               "exact_max_abs_error": max(exact) if exact else None,
               "replay_median_abs_error": statistics.median(replays) if replays else None,
               "replay_max_abs_error": max(replays) if replays else None,
               "host_fast": statistics.fmean(r["host_fast"] for r in rows) if rows else None,
               "host_fast_calibrating": statistics.fmean(calibration_fast),
               "rounds": r - cut_short, "rounds_asked": rounds, "budget_s": budget_s,
               "last_round_configurations": sum(len(x) == r for x in runs) if cut_short else None,
               "per_schedule": {n: _per_schedule([r for r in rows if r["schedule"] == n])
                                for n in names},
               "not_validated": dict(NOT_VALIDATED),
               "zero_bubble": zero_bubble_against_1f1b(rows)}
    return {"method": METHOD, "settings": asdict(settings), "link": platform.to_json(), "rows": rows,
            "summary": summary, "timelines": timelines}
