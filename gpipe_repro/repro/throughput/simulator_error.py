"""The simulator's error against measured steps, with the measurement's own uncertainty.

A configuration's error is simulated throughput / measured - 1 = measured step / simulated step - 1,
one sample per measured step (:mod:`gpipe_repro.sim.error`: :func:`error_figure`, and
:func:`paired_error_figure` for rounds each with its own calibration). Over configurations, the
median and the worst |error| are bounded by the same statistics of the intervals' ends (the median
of the rows' lower |error| bounds, the median of their upper bounds; likewise the largest). The
verdict against the targets: ``met`` when the upper bounds are within them, ``not met`` when a lower
bound exceeds one, ``inconclusive`` otherwise: a busy host widens the intervals, it leaves no row
out.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from gpipe_repro.report.measurement import CONFIDENCE, Figure
from gpipe_repro.sim.error import error_figure, paired_error_figure

__all__ = ["TARGETS", "abs_bounds", "describe", "error_by_host_state", "error_figure",
           "paired_error_figure", "summarize_errors"]

TARGETS = {"median": 0.05, "max": 0.10}


def error_by_host_state(errors: Sequence[float], fast: Sequence[float]) -> dict[str, float] | None:
    """How configurations' errors go with the host's state during their runs (`fast`: the speed
    probe's fast share, :func:`gpipe_repro.report.host.fast_share`): the Pearson correlation, and
    the median error of the rows run with the host fast less often than the median row, and of the
    others. None with fewer than 4 rows or nothing varying."""
    if len(errors) != len(fast):
        raise ValueError("one fast share per error")
    if len(errors) < 4 or len(set(fast)) < 2 or len(set(errors)) < 2:
        return None
    cut = statistics.median(fast)
    slower = [e for e, f in zip(errors, fast) if f < cut]
    faster = [e for e, f in zip(errors, fast) if f >= cut]
    if not slower:
        return None
    return {"correlation": statistics.correlation(list(fast), list(errors)), "fast_share_split": cut,
            "median_error_slower": statistics.median(slower),
            "median_error_faster": statistics.median(faster)}


def abs_bounds(error: Mapping[str, Any]) -> tuple[float, float]:
    """(lower, upper) bound of |error| from an error figure's JSON (unbounded: 0, inf)."""
    low, high = error.get("low"), error.get("high")
    if low is None or high is None:
        return 0.0, math.inf
    if low <= 0 <= high:
        return 0.0, max(-low, high)
    return min(abs(low), abs(high)), max(abs(low), abs(high))


def summarize_errors(errors: Sequence[Mapping[str, Any]],
                     targets: Mapping[str, float] = TARGETS) -> dict[str, Any]:
    """Median and worst |error| over configurations (error figures' JSON), their bounds and the
    verdict (``met`` True only when the verdict is "met")."""
    if not errors:
        return {"configurations": 0, "verdict": "inconclusive", "met": False}
    values = [abs(e["value"]) for e in errors]
    bounds = [abs_bounds(e) for e in errors]
    med = (statistics.median(b[0] for b in bounds), statistics.median(b[1] for b in bounds))
    worst = (max(b[0] for b in bounds), max(b[1] for b in bounds))
    if med[1] <= targets["median"] and worst[1] <= targets["max"]:
        bounds_say = "met"
    elif med[0] > targets["median"] or worst[0] > targets["max"]:
        bounds_say = "not met"
    else:
        bounds_say = "inconclusive"
    # an interval covering the median less than 95% of the time (a range of 3 to 5 steps) judges
    # nothing (Figure.judge); the summary made of such intervals neither
    figures = [Figure.from_json(e) for e in errors]
    short = any(f.short_of_confidence for f in figures)
    coverage = min((f.coverage for f in figures if f.coverage is not None), default=None)
    verdict = "inconclusive" if short else bounds_say
    return {"configurations": len(errors), "median_abs_error": statistics.median(values),
            "median_abs_error_bounds": list(med), "max_abs_error": max(values),
            "max_abs_error_bounds": list(worst), "targets": dict(targets), "verdict": verdict,
            "met": verdict == "met", "coverage": coverage,
            "bounds_say": bounds_say if short else None}


def describe(summary: Mapping[str, Any]) -> str:
    """"median |error| 3.1% [2.0, 4.4], worst 7.9% [6.1, 9.0] over 20 configurations: met"."""
    if not summary.get("configurations"):
        return "no configuration measured: inconclusive"

    def pct(x: float) -> str:
        return "inf" if math.isinf(x) else f"{x * 100:.1f}"
    m, w = summary["median_abs_error_bounds"], summary["max_abs_error_bounds"]
    return (f"median |error| {summary['median_abs_error'] * 100:.1f}% [{pct(m[0])}, {pct(m[1])}], worst "
            f"{summary['max_abs_error'] * 100:.1f}% [{pct(w[0])}, {pct(w[1])}] over "
            f"{summary['configurations']} configurations (targets: median <= "
            f"{summary['targets']['median']:.0%}, worst <= {summary['targets']['max']:.0%}): "
            f"{summary['verdict']}"
            + (f" (the rows' intervals cover the median {summary['coverage']:.0%} of the time, below "
               f"{CONFIDENCE:.0%}: they judge nothing; their bounds alone say {summary['bounds_say']})"
               if summary.get("bounds_say") else ""))
