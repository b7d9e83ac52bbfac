"""`make check-speedups`: the wall-clock K=2 speedup against the committed measured baseline, as a
benchmark (never a pytest threshold).

Each repetition measures K=2, M=1 and K=2, M=4 on two real stage processes
(:func:`gpipe_repro.repro.speedup_baseline.measured_speedup`), alternating which goes first, after
watching the host (:class:`gpipe_repro.report.host.HostWatch`: idle in the second before, other
processes' CPU while it ran). Only clean repetitions (:func:`gpipe_repro.report.host.is_clean`)
count; when fewer than half were, the verdict is **"host busy:
not comparable"** instead of pass or fail, because a speedup measured beside another busy process
says nothing about the pipeline (a healthy one measured 1.06-1.15 there against 1.56 idle).

    python -m experiments.check_speedups --runs 8          # compare with the committed baseline
    python -m experiments.check_speedups --runs 8 --write  # record a new measured baseline (idle host only)
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from gpipe_repro.report.host import IDLE_CLEAN, OTHERS_CLEAN, HostWatch, is_clean, usable_cores
from gpipe_repro.report.records import read_json, write_json
from gpipe_repro.repro import speedup_baseline as sb

BAND = 0.25           # relative band around the baseline speedup (two-sided)


def measure(runs: int, steps: int = 4) -> dict[str, Any]:
    """`runs` repetitions of the measured K=2 speedup, each with the host's conditions (idle before,
    load, other processes' CPU during) recorded beside it."""
    if runs < 1:
        raise ValueError(f"--runs must be >= 1, got {runs}")
    reps = []
    for i in range(runs):
        with HostWatch() as watch:
            r = sb.measured_speedup(steps=steps, many_first=i % 2 == 1)
        host = watch.conditions
        clean = bool(is_clean(host))
        reps.append({**r, **host, "clean": clean})
        others = host["others_cpu_fraction_during"]
        print(f"repetition {i + 1}/{runs}: speedup {r['speedup']:.3f}  (host idle "
              f"{host['idle_fraction_before']:.0%} before, load {host['load_average_before']:.1f}"
              + ("" if others is None else f", other processes {others:.0%} of the CPU during")
              + f"{'' if clean else ', BUSY'})", flush=True)
    return {"repetitions": reps, "idle_threshold": IDLE_CLEAN, "others_threshold": OTHERS_CLEAN,
            "usable_cores": usable_cores()}


def verdict(result: dict[str, Any], baseline: dict[str, Any] | None) -> tuple[str, str]:
    """("pass" | "fail" | "not comparable", the sentence that says why)."""
    reps = result["repetitions"]
    clean = [r["speedup"] for r in reps if r["clean"]]
    if len(clean) * 2 < len(reps) or not clean:
        return ("not comparable", f"host busy: not comparable ({len(clean)} of {len(reps)} "
                                  f"repetitions started on an idle host)")
    now = statistics.median(clean)
    if baseline is None:
        return ("not comparable", f"no measured baseline committed; median speedup {now:.3f}")
    base = baseline["speedup"]
    lo, hi = base * (1 - BAND), base * (1 + BAND)
    ok = lo <= now <= hi
    return ("pass" if ok else "fail",
            f"median speedup {now:.3f} over {len(clean)} clean repetitions; baseline {base:.3f}, "
            f"band [{lo:.3f}, {hi:.3f}]: {'within' if ok else 'OUTSIDE'}")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Command line: --runs N, --write."""
    ap = argparse.ArgumentParser(prog=prog or "python -m experiments.check_speedups",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8, help="interleaved repetitions (default 8)")
    ap.add_argument("--write", action="store_true",
                    help="record the median as the committed measured baseline (refused on a busy host)")
    args = ap.parse_args(argv)
    if usable_cores() < 2:
        sys.exit("check-speedups needs 2 usable cores (one stage process per core)")
    if not sb.BASELINE.exists():
        sys.exit(f"no baseline at {sb.BASELINE}: run `make baseline` first")
    payload = read_json(sb.BASELINE)
    result = measure(args.runs)
    state, why = verdict(result, payload.get("measured"))
    if args.write:
        clean = [r for r in result["repetitions"] if r["clean"]]
        if len(clean) * 2 < len(result["repetitions"]) or not clean:
            sys.exit(f"{why}: not writing a measured baseline taken on a busy host")
        med = statistics.median(r["speedup"] for r in clean)
        payload.pop("environment", None)
        payload["measured"] = {"speedup": med, "config": clean[0]["config"], "band": BAND,
                               "repetitions": result["repetitions"], "idle_threshold": IDLE_CLEAN}
        write_json(sb.BASELINE, payload)
        print(f"wrote the measured baseline ({med:.3f}) to {sb.BASELINE}")
        return
    print(why if state == "not comparable" else f"{state.upper()}: {why}")
    sys.exit(1 if state == "fail" else 0)
