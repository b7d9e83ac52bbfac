"""validate-unseen's figures and page: each configuration's error (uncorrected or corrected in
situ, paired round by round), the summary over configurations, and the markdown page
(:mod:`gpipe_repro.repro.validate_unseen` runs the configurations)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpipe_repro.report.measurement import Figure
from gpipe_repro.report.records import markdown_table
from gpipe_repro.repro.throughput.simulator_error import (
    describe,
    error_figure,
    paired_error_figure,
    summarize_errors,
)

__all__ = ["FACTOR_KINDS", "IN_SITU_NOTE", "corrected_step", "render", "row_error", "summarize",
           "uncorrected_step"]


def uncorrected_step(row: dict[str, Any]) -> float:
    """A configuration's simulated step from the calibrated costs alone."""
    situ = row.get("in_situ")
    return situ["uncorrected_step_time_s"] if situ else row["step_time_s"]


def corrected_step(row: dict[str, Any]) -> float | None:
    """A configuration's simulated step corrected in situ (None where it was not)."""
    return row["step_time_s"] if row.get("in_situ") else None


def row_error(row: dict[str, Any], corrected: bool = False, paired: bool = True) -> Figure:
    """A configuration's error figure (uncorrected, or `corrected` in situ), from its measured steps
    (or its median step alone): uncorrected and measured in rounds, each round's steps against the
    simulation from that round's calibration unless not `paired`."""
    per_round = row.get("uncorrected_step_per_round_s")
    if paired and not corrected and per_round:
        return paired_error_figure(list(zip(row["measured_step_times_per_round_s"], per_round)))
    steps = row.get("measured_step_times_s") or [row["measured_step_time_s"]]
    simulated = corrected_step(row) if corrected else uncorrected_step(row)
    if simulated is None:
        raise ValueError(f"{row.get('model', 'a row')} M={row['M']}: no in-situ correction")
    return error_figure(steps, simulated)


def summarize(rows: Sequence[dict[str, Any]], corrected: bool = False,
              paired: bool = True) -> dict[str, Any]:
    """Median and worst |error| (uncorrected, or `corrected` in situ; :func:`row_error`) with their
    bounds and the verdict, over the rows with micro-batches of >= 16 rows."""
    return summarize_errors([row_error(r, corrected, paired).to_json() for r in rows
                             if r["microbatch"] >= 16 and (not corrected or r.get("in_situ"))])


IN_SITU_NOTE = (
    "**The in-situ correction.** Before each configuration's (first) measured run, a separate short run "
    "trains the chosen cut on the 2 real stage processes at {m} micro-batch(es) of the configuration's "
    "size per step (3 steps after a warm-up; at M=1 `always` re-materializes); each stage's seconds "
    "per action kind (forward, recompute, backward, optimizer step) over the calibration's seconds "
    "for the same step give "
    "one factor per stage and kind, and the corrected figure simulates the configuration's schedule "
    "over the calibrated costs times those factors (`gpipe_repro/sim/in_situ.py`). The factors are "
    "computed from that run alone, never from the measured steps they are judged against. They model "
    "what a stage process pays that a per-layer calibration does not: the host's speed at run time, "
    "the stage's own cache and allocator state, the runtime's per-action overheads and the "
    "re-materialization as the executor runs it, at the configuration's micro-batch size. They do not "
    "model the schedule's bubbles, the gradient accumulation of later micro-batches or the transfers: "
    "those still come from the simulator. Nor, at M=1, the co-running stages: the stages of a "
    "fill-drain step of one micro-batch take turns, so a neighbour's load during overlapped compute "
    "is only what the calibration's busy neighbour stood in for; a run of 2 or more micro-batches "
    "overlaps them.")


def _moved(payload: dict[str, Any]) -> str:
    """One sentence: how the correction moved the median and the worst error."""
    # like for like: the corrected figure is unpaired, so is the uncorrected one it is set against
    raw = payload.get("summary_unpaired") or payload["summary"]
    fixed = payload.get("summary_in_situ") or {}
    if not raw.get("configurations") or not fixed.get("configurations"):
        return ""
    paired = "" if raw is payload["summary"] else " (unpaired, both)"
    return (f" Over the same configurations{paired} it moved the median |error| from "
            f"{raw['median_abs_error']:.1%} to {fixed['median_abs_error']:.1%} and the worst from "
            f"{raw['max_abs_error']:.1%} to {fixed['max_abs_error']:.1%}.")


def render(payload: dict[str, Any]) -> str:
    """The markdown page."""
    def error(r: dict[str, Any], corrected: bool = False) -> str:
        if corrected and corrected_step(r) is None:
            return ""
        return row_error(r, corrected).percent_cell()

    def factors(r: dict[str, Any]) -> str:
        situ = r.get("in_situ")
        if not situ:
            return ""
        return "; ".join("/".join(f"{stage.get(kind, 1.0):.2f}" for kind in FACTOR_KINDS)
                         for stage in situ["factors"])

    corrected = any(r.get("in_situ") for r in payload["rows"])
    body = [[r["model"], r["K"], r["M"], r["microbatch"], r["checkpoint"], str(r["balance"]),
             f"{r['measured_step_time_s'] * 1e3:.1f}", f"{uncorrected_step(r) * 1e3:.1f}", error(r)]
            + ([f"{r['step_time_s'] * 1e3:.1f}" if r.get("in_situ") else "", error(r, True), factors(r)]
               if corrected else [])
            for r in payload["rows"]]
    table = markdown_table(["model", "K", "M", "rows/micro-batch", "checkpoint", "partition",
                            "measured step ms", "simulated step ms",
                            "error (simulated throughput) [95% interval]"]
                           + (["in-situ corrected step ms", "corrected error [95% interval]",
                               "factors per stage (" + "/".join(FACTOR_KINDS) + ")"] if corrected else []),
                           body)
    summary = (f"Over micro-batches of >= 16 rows{', uncorrected' if corrected else ''}: "
               f"{describe(payload['summary'])}.")
    unpaired = payload.get("summary_unpaired") or {}
    if unpaired.get("configurations"):
        summary += (" Unpaired (all the steps against the simulation from the median of the rounds' "
                    f"costs, the simulated step ms column): {describe(unpaired)}.")
    if corrected:
        summary += (" In-situ corrected (unpaired, as the line before: all the steps against the "
                    "corrected simulation; compare it with that line): "
                    f"{describe(payload.get('summary_in_situ') or {})}.")
    config = payload.get("config", {})
    in_situ_m = config.get("in_situ_m", 1)
    note = f"{IN_SITU_NOTE.format(m=in_situ_m)}{_moved(payload)}\n\n" if corrected else ""
    rounds = config.get("rounds", 1)
    asked = config.get("rounds_asked") or rounds
    cut = config.get("last_round_configurations")
    short = (f" ({rounds} of the {asked} rounds asked for, and {cut} of the configurations in one more, "
             f"before the next would have ended past the {config.get('budget_s'):g} s budget.)"
             if cut is not None else
             f" ({rounds} of the {asked} rounds asked for: another would not have ended within the "
             f"{config.get('budget_s'):g} s budget.)" if asked > rounds else "")
    how = (f"In {rounds} rounds: each model calibrated afresh in every round right before its "
           f"configurations ({config.get('repeats', 20)} timings a layer and action), every "
           f"configuration run {config.get('steps', '?')} step(s) a round after 2 warm-up steps, the "
           "configurations' order alternating from round to round; the (uncorrected) error pairs each "
           "round's measured steps with the simulation from that round's calibration, as the host's "
           "speed drifts over minutes; the simulated step ms column (and the in-situ correction, "
           "whose factors divide by it) comes from the median of the model's calibrations, the cut "
           "from the first." if rounds > 1 else
           "Each configuration calibrated (or its calibration read from the cache) and measured "
           "in one burst of consecutive steps.")
    return ("# The simulator on models it was never tuned on\n\n"
            f"{summary} Each error is the "
            "median over the measured steps with its 95% interval (fewer than 6 steps: their range, "
            "with how often it covers the median, which judges nothing below 95%); "
            "the bounds of the median and the worst come from the intervals' ends (a busy host "
            "widens them).\n\n"
            f"Generated by `{payload['command']}`: each configuration run the way a user runs their own "
            "model (`gpipe-repro throughput --model module:factory ... --k 2"
            f"{' --in-situ' if corrected else ''}`): calibrate on this host, "
            "partition, simulate, then run on 2 real stage processes (1 thread each) and compare. "
            f"{how}{short} "
            "The models (`gpipe_repro/repro/validate_unseen.py`) were written for this check; no "
            "cost-model constant was fitted to them. The simulated step is the median of steps "
            "whose compute actions' durations are drawn as they vary in a pipeline on this host "
            "(`gpipe_repro/sim/jitter.py`), as the measured figure is the median measured step. "
            "Error = simulated throughput / measured - 1. "
            f"Measured on {payload['usable_cores']} usable cores.\n\n" + note + table + "\n")


#: The factor kinds the page lists per stage, in order.
FACTOR_KINDS = ("forward", "recompute", "backward", "optimizer_step")


