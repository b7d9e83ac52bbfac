"""`make check-speedups`: the wall-clock K=2 speedup against the committed measured baseline, as a
benchmark (never a pytest threshold).

K=2, M=1 and K=2, M=4 run on two real stage processes in alternating rounds of the measurement
kernel (:mod:`gpipe_repro.report.measurement`); the speedup is the median of the per-round paired
ratios (per-sample time of M=1 over M=4) with its 95% interval. The verdict against the baseline's
band: **pass** when the interval lies inside it, **fail** when it lies wholly outside, and
**inconclusive** when it straddles an edge: a busy host widens the interval, it never makes the
result "not comparable".

    python -m experiments.check_speedups                  # compare with the committed baseline
    python -m experiments.check_speedups --write          # record a new measured baseline
    python -m experiments.check_speedups --runs 10        # exactly 10 rounds
"""
from __future__ import annotations

import sys
from typing import Any

import typer

from experiments import speedup_baseline as sb
from experiments.command import Budget, MaxRounds, MinRounds, Tolerance
from gpipe_repro.report.host import usable_cores
from gpipe_repro.report.measurement import Comparison, Figure, measure
from gpipe_repro.report.records import read_json, write_json
from gpipe_repro.repro.harness import stop_rule

BAND = 0.25           # relative band around the baseline speedup (two-sided)
SPEEDUP = Comparison(f"K=2 M={sb.MEASURED_M} over K=2 M=1 speedup", "M=1", f"M={sb.MEASURED_M}",
                     tolerance=0.05)


def verdict(figure: Figure, baseline: dict[str, Any] | None) -> tuple[str, str]:
    """("pass" | "fail" | "inconclusive" | "no baseline", the sentence that says why)."""
    if baseline is None:
        return "no baseline", f"no measured baseline committed; speedup {figure.markdown()}"
    base = baseline["speedup"]
    lo, hi = base * (1 - BAND), base * (1 + BAND)
    sides = {figure.judge(lo, ">="), figure.judge(hi, "<=")}
    state = "fail" if "not met" in sides else "pass" if sides == {"met"} else "inconclusive"
    return state, (f"speedup {figure.markdown()}; baseline {base:.3f}, band [{lo:.3f}, {hi:.3f}]: "
                   + {"pass": "the interval lies inside", "fail": "the interval lies OUTSIDE",
                      "inconclusive": "the interval straddles an edge of the band (measure longer: "
                                      "--budget)"}[state])


app = typer.Typer(add_completion=False)


@app.command()
def main(runs: int | None = typer.Option(None, "--runs", min=1, help="exactly this many rounds (sets "
                                        "--min-rounds and --max-rounds)"),
         steps: int = typer.Option(4, "--steps", min=1, help="measured steps per run (their median)"),
         write: bool = typer.Option(False, "--write", help="record the median and its interval as the "
                                    "committed measured baseline"),
         budget: Budget = 300.0, tolerance: Tolerance = SPEEDUP.tolerance, min_rounds: MinRounds = 6,
         max_rounds: MaxRounds = 40) -> None:
    """The measured K=2 speedup against the committed baseline: pass, fail or inconclusive."""
    if runs is not None:
        min_rounds = max_rounds = runs
    if usable_cores() < 2:
        sys.exit("check-speedups needs 2 usable cores (one stage process per core)")
    if not sb.BASELINE.exists():
        sys.exit(f"no baseline at {sb.BASELINE}: run `make baseline` first")
    payload = read_json(sb.BASELINE)
    configs, config = sb.measured_configs(steps)
    result = measure(configs, [SPEEDUP], stop_rule(budget, tolerance, min_rounds, max_rounds),
                     label="check-speedups")
    figure = result.figures[SPEEDUP.name]
    if write:
        if figure.low is None:
            sys.exit(f"{figure.markdown()}: too few rounds for an interval; not writing a baseline "
                     "(give --min-rounds 3 or more)")
        payload.pop("environment", None)
        payload["measured"] = {"speedup": figure.value, "config": config, "band": BAND,
                               "figure": figure.to_json()}
        write_json(sb.BASELINE, payload)
        print(f"wrote the measured baseline ({figure.markdown()}) to {sb.BASELINE}")
        return
    state, why = verdict(figure, payload.get("measured"))
    print(f"{state.upper()}: {why}")
    sys.exit(1 if state == "fail" else 0)


if __name__ == "__main__":
    app()
