"""`gpipe-repro throughput --validate --rounds R`: the costs calibrated again before every measured
round, the simulation from their median, every round's steps in the figure."""
from __future__ import annotations

from typing import Any

import pytest

from gpipe_repro.models.workload import Workload
from gpipe_repro.sim import own_model
from gpipe_repro.sim.calibration import Calibration, calibrate
from tests.calibrations import slower


def test_each_round_calibrates_afresh_its_steps_are_paired_with_its_costs_and_the_median_is_simulated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    work = Workload.create("tiny residual MLP", "gpipe_repro.repro.validate_unseen:residual_mlp",
                           "features", (16,), 10, width=16, blocks=2)
    base = calibrate(work, [4, 8], method="flops")
    log: list[tuple[Any, ...]] = []

    def fake_calibrate(workload: Workload, sizes: list[int], **kw: Any) -> Calibration:
        log.append(("calibrate", tuple(sizes), kw.get("use_cache", True)))
        factor = [1.0, 1.3, 1.1, 1.2][sum(e[0] == "calibrate" for e in log) - 1]   # the host drifts
        return slower(base, factor)

    def fake_measure(workload: Workload, balance: list[int], **kw: Any) -> tuple[list[float], dict[str, Any]]:
        log.append(("measure", kw["steps"]))
        return [0.5 + 0.1 * len(log)] * kw["steps"], {"idle_fraction_before": 0.9 - 0.01 * len(log)}

    monkeypatch.setattr(own_model, "calibrate", fake_calibrate)
    monkeypatch.setattr(own_model, "measure_steps", fake_measure)
    monkeypatch.setattr(own_model, "usable_cores", lambda: 2)
    result = own_model.simulate_model(work, k=2, m=2, microbatch=4, link="ideal", validate=True,
                                      steps=2, rounds=3)
    # the first calibration (the cut, the speedup) may come from the cache: every round its own
    assert log == [("calibrate", (4, 8), True), ("calibrate", (4,), False), ("measure", 2),
                   ("calibrate", (4,), False), ("measure", 2), ("calibrate", (4,), False),
                   ("measure", 2)]
    assert result.rounds == 3 and len(result.measured_step_times_s or []) == 6
    assert result.measured_host == {"idle_fraction_before": pytest.approx(0.9 - 0.07)}
    median = own_model.predict(work, slower(base, 1.2), result.balance, m=2, microbatch=4,
                               checkpoint=result.checkpoint, link="ideal")
    assert result.step_time_s == pytest.approx(median.step_time_s, rel=1e-12)
    # each round's steps (0.8, 1.0, 1.2 s) against the simulation from that round's costs
    per_round = [own_model.predict(work, slower(base, x), result.balance, m=2, microbatch=4,
                                   checkpoint=result.checkpoint, link="ideal").step_time_s
                 for x in (1.3, 1.1, 1.2)]
    assert result.uncorrected_step_per_round_s == pytest.approx(per_round, rel=1e-12)
    assert result.measured_step_times_per_round_s == [[pytest.approx(t)] * 2 for t in (0.8, 1.0, 1.2)]
    paired = sorted(t / s - 1 for t, s in zip((0.8, 1.0, 1.2), per_round))
    error = result.error()
    assert error is not None and error.value == pytest.approx(paired[1], rel=1e-9)
    # the speedup's one-device step at the whole batch: the first calibration's
    first = own_model.predict(work, base, result.balance, m=2, microbatch=4,
                              checkpoint=result.checkpoint, link="ideal")
    assert result.single_device_step_time_s == pytest.approx(first.single_device_step_time_s)
    assert result.speedup == pytest.approx(first.speedup)   # both sides from one calibration
    text = result.describe()
    assert "median of 6 steps in 3 rounds, the costs calibrated again before each" in text
    # the measured step with its interval, as every measured figure (the steps: 0.8, 1.0, 1.2 s twice)
    assert "step 1000.0 ms [800.0, 1200.0] (median of 6 steps" in text and "interval: " in text
    # the least idle round decides, and the page says what it saw instead of "not clean"
    assert "host busy or slow: idle 83%" in text and "the error's interval spans it" in text


def test_rounds_below_one_are_refused_before_any_work() -> None:
    work = Workload.create("tiny residual MLP", "gpipe_repro.repro.validate_unseen:residual_mlp",
                           "features", (16,), 10, width=16, blocks=2)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        own_model.simulate_model(work, k=2, m=2, microbatch=4, rounds=0, validate=False)


def test_the_worst_reading_of_every_round_decides_whether_the_host_was_clean() -> None:
    """A round whose speed probe ran slow makes the whole measurement's host slow, as a round that
    was not idle makes it busy."""
    from gpipe_repro.report.host import is_clean
    clean = {"idle_fraction_before": 0.99, "others_cpu_fraction_during": 0.01, "speed_before": 1000.0,
             "speed_after": 990.0, "speed_fastest": 1000.0, "load_average_before": 0.5}
    slow = {**clean, "speed_after": 500.0, "speed_fastest": 1010.0}
    assert is_clean(clean) and not is_clean(slow)
    both = own_model.worst_host([clean, slow, clean])
    assert not is_clean(both) and both["speed_after"] == 500.0 and both["speed_fastest"] == 1010.0
    assert own_model.worst_host([clean, clean]) == clean


@pytest.mark.parametrize("validate", [False, True])
def test_only_a_prediction_compared_with_measured_steps_draws_this_host_s_durations(
        monkeypatch: pytest.MonkeyPatch, validate: bool) -> None:
    # a user's prediction (no measurement beside it) stays the exact simulation; a validated one
    # draws its actions' durations as they vary on this host's stage processes (sim/jitter)
    from gpipe_repro.sim.platform import Platform, platform_for
    work = Workload.create("tiny residual MLP", "gpipe_repro.repro.validate_unseen:residual_mlp",
                           "features", (16,), 10, width=16, blocks=2)
    base = calibrate(work, [4, 8], method="flops")
    asked: list[bool] = []

    def fake_platform(name: str, *, jitter: bool = False) -> Platform:
        asked.append(jitter)
        return platform_for("ideal")

    monkeypatch.setattr(own_model, "calibrate", lambda *a, **kw: base)
    monkeypatch.setattr(own_model, "platform_for", fake_platform)
    monkeypatch.setattr(own_model, "measure_steps", lambda *a, **kw: ([0.5, 0.5], {}))
    monkeypatch.setattr(own_model, "usable_cores", lambda: 2)
    own_model.simulate_model(work, k=2, m=2, microbatch=4, validate=validate, steps=2)
    assert asked and set(asked) == {validate}


def test_an_error_interval_counted_steps_as_rounds() -> None:
    """The simulator's error has one sample per measured step, but its interval read "range of 6
    rounds" after 2 rounds of 3 steps. It now says what it counts."""
    from gpipe_repro.sim.error import paired_error_figure

    figure = paired_error_figure([([1.0, 1.1, 1.2], 1.0), ([1.0, 1.05, 1.1], 1.05)])
    assert figure.rounds == 6 and figure.interval.startswith("order statistics 1 and 6 of 6 steps")
    assert "(n=6 steps" in figure.markdown()


@pytest.mark.parametrize("cached", [False, True])
def test_the_simulated_step_says_where_its_costs_came_from(monkeypatch: pytest.MonkeyPatch,
                                                            cached: bool) -> None:
    """Three fresh calibrations on a busy host simulated 10.5, 12.7 and 34.4 ms for one model with
    nothing beside the figure to say why. The line says whether the costs were timed now (and how
    much of that time the host was fast) or came from the cache."""
    work = Workload.create("tiny residual MLP", "gpipe_repro.repro.validate_unseen:residual_mlp",
                           "features", (16,), 10, width=16, blocks=2)
    base = calibrate(work, [4, 8], method="flops")

    def fake_calibrate(workload: Workload, sizes: list[int], **kw: Any) -> Calibration:
        for size in sizes:
            kw["progress"](f"calibrating {workload.name} at micro-batch {size} (time"
                           + (", cached)" if cached else ")"))
        return base
    monkeypatch.setattr(own_model, "calibrate", fake_calibrate)
    monkeypatch.setattr(own_model, "fast_share", lambda: 0.25)
    result = own_model.simulate_model(work, k=2, m=2, microbatch=4, link="ideal", validate=False)
    text = result.describe()
    if cached:
        assert result.calibrated == {"cached": True} and "costs from the calibration cache" in text
    else:
        assert result.calibrated == {"cached": False, "host_fast": 0.25}
        assert "costs timed now, the host fast 25% of the time around it" in text


def test_a_long_validation_says_what_runs_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """`throughput --model ... --validate` printed one line, then nothing for minutes while it
    calibrated and ran stage processes (killed at 150 s by a reviewer, its output piped): each phase
    now tells its progress line (the command prints it every 30 s off a terminal)."""
    work = Workload.create("tiny residual MLP", "gpipe_repro.repro.validate_unseen:residual_mlp",
                           "features", (16,), 10, width=16, blocks=2)
    base = calibrate(work, [4, 8], method="flops")
    monkeypatch.setattr(own_model, "calibrate",
                        lambda workload, sizes, **kw: (kw["progress"]("layer 1 of 4") if "progress" in kw
                                                       else None) or base)
    monkeypatch.setattr(own_model, "measure_steps", lambda *a, **kw: ([0.5] * kw["steps"], {}))
    monkeypatch.setattr(own_model, "usable_cores", lambda: 2)
    lines: list[str] = []
    own_model.simulate_model(work, k=2, m=2, microbatch=4, link="ideal", validate=True, steps=2,
                             rounds=2, progress=lines.append)
    assert lines[0] == "calibrating: layer 1 of 4"
    assert "round 1 of 2: calibrating the layers again" in lines
    assert any(line.startswith("round 2 of 2: 2 measured steps of the cut") for line in lines)
