"""`make validate-sim` per schedule (repro/throughput/validation.py), with made-up costs and fake
'measured' runs: the orchestration, the per-schedule summary and the refusals. Nothing is timed."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from gpipe_repro.engine.schedule import make_schedule
from gpipe_repro.repro.throughput import validation
from gpipe_repro.repro.throughput.report import render_validation_summary
from gpipe_repro.repro.throughput.settings import SweepSettings
from gpipe_repro.sim.calibration import Calibration, LayerCost
from gpipe_repro.sim.links import PRESETS
from gpipe_repro.sim.platform import Platform
from gpipe_repro.sim.simulator import simulate, stage_costs


def _calibrate(workload: Any, sizes: list[int], **kw: Any) -> Calibration:
    cost = LayerCost(forward=1e-3, forward_nograd=1e-3, recompute=1e-3, backward=2e-3, optimizer=0.0,
                     forward_flops=1.0, flops=3.0, params=1, output_bytes=0, grad_bytes=0)
    return Calibration(workload.name, "time", "synthetic", list(range(8)), {b: [cost] * 8 for b in sizes})


def _fake_measure(schedule: str, slowdown: float, split: int | None = None) -> validation.MeasureFn:
    """A 'measured' run: the simulated step of `schedule` (splitting the last `split` backwards) on
    the same costs, `slowdown` times longer, with the simulated timeline standing in for the
    measured one."""
    def run(workload: Any, balance: list[int], m: int, n: int, checkpoint: str) -> dict[str, Any]:
        cal = _calibrate(workload, [n // m])
        sim = simulate(make_schedule(schedule, len(balance), m, checkpoint, split_backwards=split),
                       stage_costs(cal, balance, [n // m] * m), PRESETS["ideal"], n)
        return {"step_time_s": sim.step_time * slowdown, "step_times": [sim.step_time * slowdown] * 8,
                "timeline": sim.timeline}
    return run


def test_validation_reports_each_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "calibrate", _calibrate)
    monkeypatch.setattr(validation, "platform_for", lambda name, **kw: Platform(PRESETS["ideal"]))
    monkeypatch.setattr(validation, "measure_jitter", lambda **kw: None)
    # the host probe times the cores: a fixed answer instead
    monkeypatch.setattr(validation, "fast_share", lambda: 0.2)
    settings = SweepSettings(link="ideal")
    slow = {"gpipe": 1.0, "1f1b": 1.25, "zb-h1": 1.02, "interleaved": 1.03}
    result = validation.validate_simulator(
        settings, _fake_measure("gpipe", 1.0), models=["transformer"], ks=[2], ms=[1, 2, 4],
        checkpoints=("never",), schedules=["gpipe", "1f1b", "zb-h1", "interleaved"],
        measure_schedule=lambda s: _fake_measure(s.schedule, slow[s.schedule], s.split_backwards))
    rows = result["rows"]
    assert "measured_*" in result["method"] and "simulated_*" in result["method"]
    # interleaved takes M in groups of the K processes: M=1 is skipped
    assert sorted((r["schedule"], r["M"]) for r in rows if r["schedule"] == "interleaved") == [
        ("interleaved", 2), ("interleaved", 4)] and len(rows) == 3 * 3 + 2
    for r in rows:        # simulated / measured throughput - 1 = slowdown - 1, exactly
        assert r["relative_error"] == pytest.approx(slow[r["schedule"]] - 1, abs=1e-12)
        if r["schedule"] == "interleaved":   # K=2 processes of 2 cells, replayed cell by cell
            assert r["K"] == 2 and r["cells"] == 4 == len(r["balance"])
        else:
            assert r["K"] == r["cells"] == 2
        # the replay pads the measured timeline to the measured step: the pipeline model is exact
        assert r["replay_error"] == pytest.approx(0.0, abs=1e-9)
    # zero bubble runs the split count its simulation chose, per M, and says so
    for r in rows:
        if r["schedule"] == "zb-h1":
            assert r["split_choice"]["split_backwards"] == r["split_backwards"] <= r["M"]
            assert r["split_choice"]["balance"] == r["balance"]
        else:
            assert r["split_backwards"] is None and r["split_choice"] is None
    per = result["summary"]["per_schedule"]
    assert per["gpipe"]["met"] and per["zb-h1"]["met"] and not per["1f1b"]["met"]
    assert per["1f1b"]["max_abs_error"] == pytest.approx(0.25) and per["1f1b"]["configurations"] == 3
    assert per["interleaved"]["met"] and per["interleaved"]["configurations"] == 2
    assert not result["summary"]["met"] and result["summary"]["not_validated"] == {}
    assert {"transformer_K2_M4_never", "transformer_K2_M4_never_zb-h1"} <= set(result["timelines"])
    text = render_validation_summary(result)
    assert "`1f1b` median |error| 25.0% [25.0, 25.0], worst 25.0% [25.0, 25.0]" in text
    assert per["1f1b"]["verdict"] == "not met" and "| zb-h1 " in text
    assert "| interleaved " in text and "not validated" not in text


def test_validation_refuses_what_it_cannot_measure() -> None:
    settings = SweepSettings(link="ideal")
    with pytest.raises(ValueError, match="cannot validate dualpipe: 'dualpipe' is not a schedule"):
        validation.validate_simulator(settings, _fake_measure("gpipe", 1.0), schedules=["dualpipe"])
    with pytest.raises(ValueError, match="pass measure_schedule= to measure 1f1b"):
        validation.validate_simulator(settings, _fake_measure("gpipe", 1.0), schedules=["gpipe", "1f1b"])


def test_a_wide_interval_makes_the_verdict_inconclusive_not_a_left_out_row() -> None:
    from gpipe_repro.repro.throughput.simulator_error import error_figure, summarize_errors

    tight = [error_figure([1.02] * 8, 1.0).to_json(), error_figure([0.99] * 8, 1.0).to_json()]
    assert summarize_errors(tight)["verdict"] == "met"
    busy = error_figure([0.9, 1.0, 1.1, 1.2, 0.95, 1.05, 1.15, 1.0], 1.0).to_json()   # straddles 10%
    s = summarize_errors([*tight, busy])
    assert s["verdict"] == "inconclusive" and s["configurations"] == 3
    off = [error_figure([1.3] * 8, 1.0).to_json()] * 3
    assert summarize_errors(off)["verdict"] == "not met"
    # ranges of 4 steps cover the median 88% of the time: they judge nothing, and so their summary
    short = [error_figure([1.3, 1.31, 1.32, 1.33], 1.0).to_json()] * 3
    s = summarize_errors(short)
    assert (s["verdict"], s["bounds_say"], s["coverage"]) == ("inconclusive", "not met", 0.875)
    from gpipe_repro.repro.throughput.simulator_error import describe
    assert "cover the median 88% of the time, below 95%: they judge nothing; their bounds alone " \
           "say not met" in describe(s)


def test_each_configuration_is_measured_once_per_round_in_alternating_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose speed drifts during the validation: measured in one burst each, the first
    configurations would see one speed and the last another; in interleaved rounds (forward, then
    backward) every configuration's steps span the drift, and its figure is their median."""
    events: list[str] = []

    def calibrating(workload: Any, sizes: list[int], **kw: Any) -> Calibration:
        events.append("calibrate")
        return _calibrate(workload, sizes, **kw)
    monkeypatch.setattr(validation, "calibrate", calibrating)
    monkeypatch.setattr(validation, "platform_for", lambda name, **kw: Platform(PRESETS["ideal"]))
    monkeypatch.setattr(validation, "measure_jitter",
                        lambda **kw: events.append(f"variation refresh={kw.get('refresh')}"))
    monkeypatch.setattr(validation, "fast_share", lambda: 0.5)
    calls: list[int] = []
    exact = _fake_measure("gpipe", 1.0)

    def drifting(workload: Any, balance: list[int], m: int, n: int, checkpoint: str) -> dict[str, Any]:
        got = exact(workload, balance, m, n, checkpoint)
        calls.append(m)
        events.append(f"M={m}")
        slow = 1.0 + 0.1 * (len(calls) - 1)          # the host slows down call after call
        return {**got, "step_time_s": got["step_time_s"] * slow,
                "step_times": [t * slow for t in got["step_times"]]}
    result = validation.validate_simulator(SweepSettings(link="ideal"), drifting, models=["transformer"],
                                           ks=[2], ms=[1, 2, 4], checkpoints=("never",), rounds=3)
    assert calls == [1, 2, 4, 4, 2, 1, 1, 2, 4]
    # the costs are calibrated again before every round: costs and steps span the same moments;
    # the host's variation of action durations is measured afresh, not read from the cache
    assert events == ["variation refresh=True", "calibrate", "M=1", "M=2", "M=4", "calibrate", "M=4",
                      "M=2", "M=1", "calibrate", "M=1", "M=2", "M=4"]
    rows = result["rows"]
    assert [r["measured_rounds"] for r in rows] == [3, 3, 3]
    assert all(len(r["measured_step_times_s"]) == 3 * 8 for r in rows)
    # M=1 ran at slowdowns 1.0, 1.5, 1.6 and M=2 at 1.1, 1.4, 1.7: each the median of its three
    assert [r["relative_error"] for r in rows] == pytest.approx([0.5, 0.4, 0.3])
    assert "measured in 3 rounds" in render_validation_summary(result)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        validation.validate_simulator(SweepSettings(link="ideal"), drifting, rounds=0)


def test_calibrations_taken_at_several_moments_pool_to_their_median() -> None:
    def cal(seconds: float, bytes_: int) -> Calibration:
        cost = LayerCost(forward=seconds, forward_nograd=seconds, recompute=seconds, backward=2 * seconds,
                         optimizer=0.0, forward_flops=1.0, flops=3.0, params=1, output_bytes=bytes_,
                         grad_bytes=bytes_, backward_input=seconds, backward_weight=None)
        return Calibration("w", "time", "cpu", [0, 0], {4: [cost, cost]}, seconds / 10, {4: seconds / 100})
    pooled = Calibration.median_of([cal(1.0, 8), cal(3.0, 8), cal(2.0, 8)])
    layer = pooled.at(4)[0]
    assert (layer.forward, layer.backward, layer.backward_input) == (2.0, 4.0, 2.0)
    assert layer.backward_weight is None and layer.output_bytes == 8 and layer.flops == 3.0
    assert pooled.optimizer_call == pytest.approx(0.2) and pooled.uncertainty_at(4) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="cannot be pooled"):
        Calibration.median_of([cal(1.0, 8), Calibration("w", "time", "cpu", [0], {4: []})])


def test_each_rounds_steps_are_compared_with_that_rounds_calibration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A host twice as slow in round 2 as in rounds 1 and 3, in its calibrations as in its measured
    steps: each round's steps against that round's own costs err by nothing, where all the steps
    against the median of the rounds' costs spread from 0 to +100%. The second round runs the
    configurations in reverse, and each model is calibrated right before its own configurations."""
    events: list[str] = []
    measured: list[int] = []

    def slowdown() -> float:   # the host's slow phase: the second round's 4 runs
        return 2.0 if 4 <= len(measured) < 8 else 1.0

    def calibrating(workload: Any, sizes: list[int], **kw: Any) -> Calibration:
        events.append(f"calibrate {workload.name.split()[0]}")
        cal, x = _calibrate(workload, sizes), slowdown()
        return replace(cal, costs={b: [replace(c, forward=c.forward * x, forward_nograd=c.forward_nograd * x,
                                               recompute=c.recompute * x, backward=c.backward * x)
                                       for c in cs] for b, cs in cal.costs.items()})
    monkeypatch.setattr(validation, "calibrate", calibrating)
    monkeypatch.setattr(validation, "platform_for", lambda name, **kw: Platform(PRESETS["ideal"]))
    monkeypatch.setattr(validation, "measure_jitter", lambda **kw: None)
    monkeypatch.setattr(validation, "fast_share", lambda: 0.5)
    exact = _fake_measure("gpipe", 1.0)

    def measuring(workload: Any, balance: list[int], m: int, n: int, checkpoint: str) -> dict[str, Any]:
        got, x = exact(workload, balance, m, n, checkpoint), slowdown()
        measured.append(m)
        events.append(f"{workload.name.split()[0]} M={m}")
        return {**got, "step_time_s": got["step_time_s"] * x,
                "step_times": [t * x for t in got["step_times"]]}
    result = validation.validate_simulator(SweepSettings(link="ideal"), measuring,
                                           models=["transformer", "amoebanet"], ks=[2], ms=[1, 2],
                                           checkpoints=("never",), rounds=3)
    t, a = "Transformer-48", "AmoebaNet-D"
    assert events == [f"calibrate {t}", f"calibrate {a}", f"{t} M=1", f"{t} M=2", f"{a} M=1", f"{a} M=2",
                      f"calibrate {a}", f"{a} M=2", f"{a} M=1", f"calibrate {t}", f"{t} M=2", f"{t} M=1",
                      f"calibrate {t}", f"{t} M=1", f"{t} M=2", f"calibrate {a}", f"{a} M=1", f"{a} M=2"]
    for r in result["rows"]:
        assert [r["error"][x] for x in ("value", "low", "high")] == pytest.approx([0, 0, 0], abs=1e-9)
        assert r["unpaired_error"]["high"] == pytest.approx(1.0)
        assert r["simulated_step_per_round_s"][1] == pytest.approx(2 * r["simulated_step_per_round_s"][0])
    assert result["summary"]["met"] and not result["summary"]["unpaired"]["met"]
    assert "Unpaired (all the steps against" in render_validation_summary(result)


def test_errors_by_the_hosts_state_split_at_the_median_fast_share() -> None:
    from gpipe_repro.repro.throughput.simulator_error import error_by_host_state

    state = error_by_host_state([0.30, 0.20, 0.02, 0.04], [0.1, 0.2, 0.6, 0.8])
    assert state is not None and state["fast_share_split"] == pytest.approx(0.4)
    assert state["median_error_slower"] == pytest.approx(0.25)
    assert state["median_error_faster"] == pytest.approx(0.03)
    assert state["correlation"] < -0.9
    assert error_by_host_state([0.1, 0.2, 0.3], [0.1, 0.2, 0.3]) is None          # too few rows
    assert error_by_host_state([0.1, 0.2, 0.3, 0.4], [0.5] * 4) is None            # nothing varies
    with pytest.raises(ValueError, match="one fast share per error"):
        error_by_host_state([0.1], [0.1, 0.2])
    from gpipe_repro.repro.throughput.simulator_error import summarize_errors

    page = render_validation_summary({"rows": [], "summary": {
        **summarize_errors([]), "by_host_fast": state, "host_fast": 0.35, "host_fast_calibrating": 0.6}})
    assert ("run with the host fast less than 40% of the time err by a median of +25.0%, the others "
            "+3.0%; the host was fast 35% of the time around the runs and 60% around the calibrations"
            in page)


def test_a_round_past_the_second_starts_only_where_it_fits_the_budget() -> None:
    from gpipe_repro.report.measurement import another_round

    assert another_round(0, 3, 999.0, 10.0) and another_round(1, 3, 999.0, 10.0)   # two at least
    assert another_round(2, 3, 200.0, 300.0)          # 200 s + a round of 100 s fits in 300
    assert not another_round(2, 3, 201.0, 300.0)      # 201 + 100.5 does not
    assert another_round(2, 3, 1e6, None) and not another_round(3, 3, 0.0, None)
    assert not another_round(1, 1, 0.0, 100.0)


def _timed_validation(monkeypatch: pytest.MonkeyPatch, now: list[float]) -> Callable[..., dict[str, Any]]:
    """validate_simulator of two configurations whose runs take 50 s each on the clock `now`
    (calibrations take none): a round of 2 runs, 100 s. Call it with budget_s= (and clock=)."""
    monkeypatch.setattr(validation, "calibrate", _calibrate)
    monkeypatch.setattr(validation, "platform_for", lambda name, **kw: Platform(PRESETS["ideal"]))
    monkeypatch.setattr(validation, "measure_jitter", lambda **kw: None)
    monkeypatch.setattr(validation, "fast_share", lambda: 0.5)
    exact = _fake_measure("gpipe", 1.0)

    def measuring(*args: Any) -> dict[str, Any]:
        now[0] += 50.0
        return exact(*args)
    return lambda **kw: validation.validate_simulator(
        SweepSettings(link="ideal"), measuring, models=["transformer"], ks=[2], ms=[1, 2],
        checkpoints=("never",), rounds=3, **{"clock": lambda: now[0], **kw})


def test_validation_stops_after_the_second_round_when_a_third_would_not_fit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    validate = _timed_validation(monkeypatch, now)
    result = validate(budget_s=250.0)
    assert [r["measured_rounds"] for r in result["rows"]] == [2, 2]
    assert (result["summary"]["rounds"], result["summary"]["rounds_asked"]) == (2, 3)
    assert "2 of the 3 rounds asked for: another would not have ended within the 250 s budget" in (
        render_validation_summary(result))
    again = validate(budget_s=300.0, clock=lambda: now[0] - 400.0)
    assert [r["measured_rounds"] for r in again["rows"]] == [3, 3]


def test_a_slow_hours_second_round_ended_past_the_limit_of_make_results(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second round always started (two rounds at least), and in a slow hour it ran past the
    600 s that `make results` gives validate-sim, which lost the part's results. A round after the
    first now ends at the first configuration whose last run would not end within the budget; the
    configurations it ran keep their extra run, and the page says so."""
    now = [0.0]
    result = _timed_validation(monkeypatch, now)(budget_s=160.0)
    assert now[0] == 150.0                 # the second round's second run would have ended at 200 s
    assert [r["measured_rounds"] for r in result["rows"]] == [1, 2]   # round 2 runs M=2 first
    assert (result["summary"]["rounds"], result["summary"]["last_round_configurations"]) == (1, 1)
    assert ("1 of the 3 rounds asked for, and 1 of the 2 configurations of one more (with a run more "
            "each) before the next would have ended past the 160 s budget"
            ) in render_validation_summary(result)


def test_zero_bubble_is_compared_with_1f1b_step_by_step_within_each_round() -> None:
    """validate-sim's page answers the schedules issue's question: each schedule that splits
    backwards against 1F1B of the same model, checkpoint mode and M, their measured steps paired
    in order (both were measured in every round), 1F1B's time over its."""
    from gpipe_repro.repro.throughput.report import render_validation_summary
    from gpipe_repro.repro.throughput.validation import zero_bubble_against_1f1b

    def row(schedule: str, cells: int, steps: list[float], m: int = 8) -> dict[str, object]:
        return {"model": "mlp", "checkpoint": "never", "M": m, "schedule": schedule, "cells": cells,
                "balance": [1] * cells, "measured_step_times_s": steps}
    rows = [row("1f1b", 2, [1.0, 1.2, 1.1, 1.0, 1.0, 1.2]), row("zb-h1", 2, [0.8, 1.0, 1.0, 0.9, 0.8, 1.0]),
            row("gpipe", 2, [2.0] * 6), row("zb-v", 4, [2.0, 2.4, 2.2, 2.0, 2.0, 2.4]),
            row("zb-h1", 2, [1.0, 1.0, 1.0], m=2)]            # no 1f1b at M=2: no row
    got = zero_bubble_against_1f1b(rows)
    assert [(g["schedule"], g["M"]) for g in got] == [("zb-h1", 8), ("zb-v", 8)]
    zb = got[0]["ratio"]
    assert zb["samples"] == pytest.approx([1.25, 1.2, 1.1, 1.0 / 0.9, 1.25, 1.2])
    assert zb["verdict"] == "met" and got[1]["ratio"]["verdict"] == "not met"
    # four pairs: a range covering the median 88% judges nothing
    four = zero_bubble_against_1f1b([{**r, "measured_step_times_s": r["measured_step_times_s"][:4]}
                                     for r in rows[:2]])
    assert four[0]["ratio"]["verdict"] == "inconclusive"
    page = render_validation_summary({"rows": [], "summary": {
        "median_abs_error": 0.0, "max_abs_error": 0.0, "zero_bubble": got}})
    assert "met on 1 of 2" in page and "| zb-v" in page


def test_silent_zero_bubble_comparison_kept_one_k_of_several() -> None:
    """Rows of K=2 and K=4 (a host with 4 or more cores validates both): each K's zero-bubble row
    is compared with 1F1B of the same K; grouping without K kept only the last K's comparison."""
    rows = [{"model": "m", "K": k, "cells": k, "checkpoint": "never", "M": 8, "schedule": s,
             "balance": [1] * k, "split_backwards": 1 if s == "zb-h1" else None,
             "measured_step_times_s": [t] * 4}
            for k in (2, 4) for s, t in (("1f1b", 1.0), ("zb-h1", 0.5 if k == 2 else 2.0))]
    out = validation.zero_bubble_against_1f1b(rows)
    assert sorted((v["K"], round(v["ratio"]["value"], 6)) for v in out) == [(2, 2.0), (4, 0.5)]


def test_a_split_count_the_settings_give_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "calibrate", _calibrate)
    monkeypatch.setattr(validation, "platform_for", lambda name, **kw: Platform(PRESETS["ideal"]))
    monkeypatch.setattr(validation, "measure_jitter", lambda **kw: None)
    monkeypatch.setattr(validation, "fast_share", lambda: 0.2)
    settings = SweepSettings(link="ideal", schedule="zb-h1", split_backwards=2)
    result = validation.validate_simulator(
        settings, _fake_measure("zb-h1", 1.0, 2), models=["transformer"], ks=[2], ms=[4],
        checkpoints=("never",), measure_schedule=lambda s: _fake_measure(s.schedule, 1.0, s.split_backwards))
    assert [(r["split_backwards"], r["split_choice"]) for r in result["rows"]] == [(2, None)]
    # without measure_schedule nothing is chosen: the settings' schedule as they give it
    plain = validation.validate_simulator(replace(settings, split_backwards=None),
                                          _fake_measure("zb-h1", 1.0), models=["transformer"], ks=[2],
                                          ms=[4], checkpoints=("never",))
    assert [r["split_backwards"] for r in plain["rows"]] == [None]
