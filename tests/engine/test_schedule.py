"""The schedule as data: generation, validation, rendering."""
from __future__ import annotations

import dataclasses

import pytest

from gpipe_repro.engine.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    gpipe_schedule,
    make_schedule,
    one_f_one_b_schedule,
)

A = ActionKind


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ahead", [False, True])
def test_generated_schedules_validate(k: int, m: int, mode: str, name: str, ahead: bool) -> None:
    s = make_schedule(name, k, m, mode, ahead)
    s.validate()
    for stage in range(k):
        kinds = [a.kind for a in s.stages[stage]]
        assert kinds.count(A.FORWARD) == m and kinds.count(A.BACKWARD) == m
        assert kinds[-2:] == [A.AGREE, A.OPTIMIZER_STEP]
        expected = {"always": m, "except_last": m - 1, "never": 0}[mode]
        assert kinds.count(A.RECOMPUTE) == expected


def test_gpipe_picture_fill_then_drain() -> None:
    # Every stage updates together, after the AGREE barrier (all gradients final everywhere).
    assert gpipe_schedule(3, 4, "never").render() == "\n".join([
        "stage 0 |F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 U  |",
        "stage 1 |.  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .  U  |",
        "stage 2 |.  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  U  |"])


def test_agree_is_a_barrier_in_the_interpreter() -> None:
    from gpipe_repro.engine.interpreter import run_dataflow
    events = run_dataflow(gpipe_schedule(3, 2, "never"),
                          duration=lambda a: {A.FORWARD: 1.0, A.BACKWARD: 2.0, A.AGREE: 0.5}.get(a.kind, 0.0))
    agree = [e for e in events if e.action.kind is A.AGREE]
    assert len(agree) == 3
    last_backward = max(e.end for e in events if e.action.kind is A.BACKWARD)
    assert all(e.ready == last_backward and e.end == last_backward + 0.5 for e in agree)
    assert min(e.start for e in events if e.action.kind is A.OPTIMIZER_STEP) == last_backward + 0.5


@pytest.mark.parametrize("drop", ["agree", "move"])
def test_validator_needs_agree_right_before_the_update(drop: str) -> None:
    good = gpipe_schedule(2, 2, "never")
    acts = list(good.stages[1])
    agree = acts.pop(-2)
    if drop == "move":
        acts.insert(0, agree)
    stages = (good.stages[0], tuple(acts))
    with pytest.raises(ScheduleError, match="AGREE"):
        dataclasses.replace(good, stages=stages).validate()


def test_forward_only_schedule_has_no_agree() -> None:
    s = gpipe_schedule(2, 3, training=False)
    assert all(a.kind is not A.AGREE for st in s.stages for a in st)
    s.validate()


def test_bubble_matches_theory_with_unit_costs() -> None:
    # With unit forward/backward costs the fill-drain bubble is (K-1)/(M+K-1) of the compute span.
    from gpipe_repro.engine.interpreter import run_dataflow
    k, m = 4, 6
    events = run_dataflow(gpipe_schedule(k, m, "never"),
                          duration=lambda a: 1.0 if a.kind in (A.FORWARD, A.BACKWARD) else 0.0)
    span = max(e.end for e in events)
    assert span == 2 * (m + k - 1)
    busy = 2 * m
    assert (span - busy) / span == pytest.approx((k - 1) / (m + k - 1))


def test_recompute_ahead_moves_recompute_before_the_gradient_wait() -> None:
    late = gpipe_schedule(2, 3, "always").stages[0]
    early = gpipe_schedule(2, 3, "always", recompute_ahead=True).stages[0]
    assert late.index(Action(A.RECV_GRAD, 0, 2)) < late.index(Action(A.RECOMPUTE, 0, 2))
    assert early.index(Action(A.RECOMPUTE, 0, 2)) < early.index(Action(A.RECV_GRAD, 0, 2))


def test_one_f_one_b_limits_in_flight_microbatches() -> None:
    s = one_f_one_b_schedule(4, 8)
    for stage, actions in enumerate(s.stages):
        live = peak = 0
        for a in actions:
            live += a.kind is A.FORWARD
            live -= a.kind is A.BACKWARD
            peak = max(peak, live)
        assert peak == 4 - stage


def _replace(s: Schedule, stage: int, actions: list[Action]) -> Schedule:
    stages = list(s.stages)
    stages[stage] = tuple(actions)
    return dataclasses.replace(s, stages=tuple(stages))


def test_validator_rejects_missing_and_repeated_actions() -> None:
    s = gpipe_schedule(2, 2, "never")
    acts = list(s.stages[1])
    with pytest.raises(ScheduleError, match="b1 is missing|B1 is missing"):
        _replace(s, 1, [a for a in acts if a != Action(A.BACKWARD, 1, 1)]).validate()
    with pytest.raises(ScheduleError, match="repeated"):
        _replace(s, 1, acts + [Action(A.FORWARD, 1, 0)]).validate()


def test_validator_rejects_wrong_local_order() -> None:
    s = gpipe_schedule(2, 2, "always")
    acts = list(s.stages[0])
    i, j = acts.index(Action(A.RECOMPUTE, 0, 1)), acts.index(Action(A.BACKWARD, 0, 1))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match="comes before"):
        _replace(s, 0, acts).validate()


def test_validator_detects_deadlock() -> None:
    # Stage 1 waits for micro-batch 1 first while stage 0 sends micro-batch 0 first: fine (sends are
    # non-blocking). But stage 0 waiting for a gradient before sending its activations deadlocks.
    s = gpipe_schedule(2, 1, "never")
    acts = list(s.stages[0])
    send = acts.pop(acts.index(Action(A.SEND_ACT, 0, 0)))
    acts.insert(acts.index(Action(A.BACKWARD, 0, 0)), send)
    with pytest.raises(ScheduleError, match="deadlocks"):
        _replace(s, 0, acts).validate()


def test_unknown_schedule_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="schedule must be one of"):
        make_schedule("zigzag", 2, 2, "never")
    with pytest.raises(ValueError, match="micro-batches must be >= 1"):
        gpipe_schedule(2, 0)
