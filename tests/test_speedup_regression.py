"""CI holds the pipeline's speedups to the committed baseline (results/baselines/speedups.json):
exactly for the deterministic FLOP-cost simulation, within a noise band for a real K=2 run. The
baseline is only ever written by `make baseline`; these tests read it."""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from gpipe_repro.report.records import read_json
from gpipe_repro.repro import speedup_baseline as sb


@pytest.fixture(scope="module")
def baseline() -> dict[str, Any]:
    assert sb.BASELINE.exists(), "no committed baseline: run `make baseline` and commit it"
    return read_json(sb.BASELINE)


@pytest.fixture(scope="module")
def calibrations() -> dict[str, Any]:
    return sb.flop_calibrations()


@pytest.fixture(scope="module")
def flop_now(calibrations: dict[str, Any]) -> dict[str, float]:
    return sb.flop_speedups(calibrations)


def test_flop_cost_speedups_have_not_dropped(baseline: dict[str, Any],
                                             flop_now: dict[str, float]) -> None:
    assert sorted(flop_now) == sorted(baseline["flop"]["speedups"])
    assert sb.check({"flop": flop_now}, {"flop": baseline["flop"]}) == []
    # Pipelining must pay off at all: the sweep's K=8, M=32 is well above K=2, M=1.
    assert flop_now["transformer K=8 M=32"] > 4.0


def test_measured_k2_speedup_is_within_the_noise_band(baseline: dict[str, Any]) -> None:
    now = sb.measured_speedup(steps=3)
    failures = sb.check({"flop": {}, "measured": now},
                        {"flop": {"speedups": {}}, "measured": baseline["measured"]})
    assert failures == [], f"{failures} (step times {now['step_time_s']})"
    # Pipelining must pay off. No upper bound: with micro-batches of 8 rows on this small model, M=4
    # also gains per-sample efficiency over M=1, so the fill-drain figure 2M/(M+1) = 1.6 can be beaten
    # (1.96 was seen) without anything being wrong.
    assert now["speedup"] > 1.0


def test_the_checker_catches_an_injected_slowdown(baseline: dict[str, Any],
                                                  calibrations: dict[str, Any]) -> None:
    def slow_middle_layer(model: str, calib: Any) -> Any:
        calib = copy.deepcopy(calib)
        for costs in calib.costs.values():
            i = len(costs) // 2
            costs[i] = replace(costs[i], forward=costs[i].forward * 4,
                               forward_nograd=costs[i].forward_nograd * 4,
                               recompute=costs[i].recompute * 4, backward=costs[i].backward * 4)
        return calib

    slowed = sb.flop_speedups(calibrations, perturb=slow_middle_layer)
    failures = sb.check({"flop": slowed}, {"flop": baseline["flop"]})
    assert any("transformer K=8 M=32" in f for f in failures)
    assert all("dropped" in f for f in failures)
    # A measured speedup below the noise band fails too; one inside it does not.
    measured = baseline["measured"]
    low = {"speedup": measured["speedup"] * (1 - measured["noise_band"]) * 0.99}
    ok = {"speedup": measured["speedup"] * (1 - measured["noise_band"]) * 1.01}
    empty = {"flop": {"speedups": {}}, "measured": measured}
    assert sb.check({"flop": {}, "measured": low}, empty)
    assert sb.check({"flop": {}, "measured": ok}, empty) == []


def test_the_checker_allows_improvements_but_not_missing_configurations(
        baseline: dict[str, Any], flop_now: dict[str, float]) -> None:
    better = {k: v * 1.1 for k, v in flop_now.items()}
    assert sb.check({"flop": better}, {"flop": baseline["flop"]}) == []
    fewer = dict(flop_now)
    fewer.pop("amoebanet K=4 M=4")
    assert sb.check({"flop": fewer}, {"flop": baseline["flop"]}) == [
        f"amoebanet K=4 M=4: missing from the current sweep "
        f"(baseline {baseline['flop']['speedups']['amoebanet K=4 M=4']:.6f})"]
