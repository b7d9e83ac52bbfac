"""The in-situ correction's arithmetic: per (stage, action kind) factors from timelines, applied to
the stage costs the simulator runs."""
from __future__ import annotations

import pytest

from gpipe_repro.engine.timeline import Event, Timeline
from gpipe_repro.sim.in_situ import factors, scaled
from gpipe_repro.sim.simulator import PipelineCosts


def _timeline(forward: float, backward: float) -> Timeline:
    return Timeline(2, [Event(0, "forward", 0, 0.0, forward),
                        Event(0, "backward", 0, 1.0, 1.0 + backward),
                        Event(1, "forward", 0, 0.0, forward),
                        Event(1, "backward", 0, 1.0, 1.0 + 2 * backward)], {})


def test_factors_are_measured_over_simulated_per_stage_and_kind() -> None:
    measured = [_timeline(2.0, 3.0), _timeline(2.2, 3.0), _timeline(1.8, 3.0)]
    per_stage = factors(measured, _timeline(1.0, 1.0))
    assert per_stage[0]["forward"] == pytest.approx(2.0)
    assert per_stage[0]["backward"] == pytest.approx(3.0)
    assert per_stage[1]["backward"] == pytest.approx(3.0)
    assert per_stage[0]["recompute"] == 1.0          # no such action on either side: unchanged


def test_scaled_multiplies_each_stage_s_costs_by_its_factors() -> None:
    costs = PipelineCosts(forward=[[1.0, 1.0], [2.0, 2.0]], forward_nograd=[[0.5, 0.5], [1.0, 1.0]],
                          recompute=[[1.0, 1.0], [1.0, 1.0]], backward=[[2.0, 2.0], [4.0, 4.0]],
                          optimizer=[0.1, 0.2], boundary_bytes=[[8.0, 8.0]], grad_bytes=[[8.0, 8.0]],
                          accumulate=[[0.5, 0.5], [0.5, 0.5]])
    one = {"forward": 1.0, "recompute": 1.0, "backward": 1.0, "optimizer_step": 1.0}
    out = scaled(costs, [{**one, "forward": 2.0}, {**one, "backward": 3.0, "optimizer_step": 0.5}])
    assert out.forward == [[2.0, 2.0], [2.0, 2.0]] and out.forward_nograd[0] == [1.0, 1.0]
    assert out.backward[1] == [12.0, 12.0] and out.accumulate == [[0.5, 0.5], [1.5, 1.5]]
    assert out.optimizer == [0.1, 0.1] and out.boundary_bytes == costs.boundary_bytes
    assert out.backward_input is None


def test_simulate_model_applies_the_correction_and_records_it() -> None:
    from gpipe_repro.models.workload import Workload
    from gpipe_repro.sim.own_model import simulate_model
    work = Workload.create("tiny residual MLP", "gpipe_repro.repro.validate_unseen:residual_mlp", "features",
                          (16,), 10, width=16, blocks=2)
    result = simulate_model(work, k=2, m=2, microbatch=4, checkpoint="always", repeats=2, validate=False,
                            in_situ=True)
    assert result.in_situ is not None and len(result.in_situ["factors"]) == 2
    assert all(f > 0 for stage in result.in_situ["factors"] for f in stage.values())
    assert result.in_situ["uncorrected_step_time_s"] > 0 and result.step_time_s > 0


def test_a_zero_bubble_backward_is_read_from_its_two_halves() -> None:
    def zb(i: float, w: float) -> Timeline:
        return Timeline(1, [Event(0, "forward", 0, 0.0, 1.0), Event(0, "backward_input", 0, 1.0, 1.0 + i),
                            Event(0, "backward_weight", 0, 2.0, 2.0 + w)], {})
    per_stage = factors([zb(3.0, 3.0)], zb(1.0, 2.0))
    assert per_stage[0]["backward"] == pytest.approx(2.0) and per_stage[0]["forward"] == 1.0


@pytest.mark.parametrize("schedule, device, says", [
    ("interleaved", "cpu", "one process per cell"),
    ("gpipe", "cuda", "device='cpu'"),
])
def test_in_situ_is_refused_before_any_work_where_it_cannot_run(schedule: str, device: str,
                                                                says: str) -> None:
    from gpipe_repro.models.workload import Workload
    from gpipe_repro.sim import own_model

    work = Workload.create("tiny", "gpipe_repro.repro.validate_unseen:residual_mlp", "features", (16,), 10,
                           width=16, blocks=2)
    with pytest.raises(ValueError, match=says):
        own_model.simulate_model(work, k=2, m=2, microbatch=4, schedule=schedule, device=device,
                                 validate=False, in_situ=True)


def test_in_situ_needs_a_core_per_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_repro.models.workload import Workload
    from gpipe_repro.sim import own_model

    monkeypatch.setattr(own_model, "usable_cores", lambda: 1)
    monkeypatch.setattr(own_model, "calibrate", lambda *a, **kw: pytest.fail("calibrated first"))
    work = Workload.create("tiny", "gpipe_repro.repro.validate_unseen:residual_mlp", "features", (16,), 10,
                           width=16, blocks=2)
    with pytest.raises(ValueError, match="1 usable core.*use k <= 1"):
        own_model.simulate_model(work, k=2, m=2, microbatch=4, validate=False, in_situ=True)


# Known factors per stage and kind, all different, so that one applied to the wrong stage or kind
# changes the corrected figure.
KNOWN = [{"forward": 1.3, "recompute": 0.9, "backward": 1.7, "optimizer_step": 2.0},
         {"forward": 0.8, "recompute": 1.1, "backward": 1.2, "optimizer_step": 0.5}]


@pytest.mark.parametrize("schedule, checkpoint, short_m", [
    ("gpipe", "except_last", 1), ("gpipe", "never", 1), ("zb-h1", "always", 1), ("gpipe", "except_last", 2)])
def test_the_corrected_figure_is_the_simulation_of_the_scaled_costs(
        monkeypatch: pytest.MonkeyPatch, schedule: str, checkpoint: str, short_m: int) -> None:
    """The in-situ run is replaced by the calibration's own M=1 step with every action of stage s
    and kind k taking KNOWN[s][k] times as long: the factors recovered are KNOWN, and the corrected
    step is the schedule simulated over scaled(stage costs, KNOWN), computed here independently."""
    from gpipe_repro.engine.microbatch import split_sizes
    from gpipe_repro.engine.schedule import make_schedule
    from gpipe_repro.models.workload import Workload
    from gpipe_repro.sim import in_situ, own_model
    from gpipe_repro.sim.calibration import calibrate
    from gpipe_repro.sim.platform import platform_for
    from gpipe_repro.sim.simulator import simulate, simulate_config, stage_costs

    work = Workload.create("residual MLP", "gpipe_repro.repro.validate_unseen:residual_mlp",
                           "features", (256,), 10, width=256, blocks=4)
    k, m, b = 2, 4, 16
    calib = calibrate(work, [b, m * b], method="flops", device="cpu", threads=1, repeats=2, neighbours=0)
    link = platform_for("ideal")
    seen: dict[str, str] = {}

    def fake_run(build: object, balance: list[int], sample: object, *, checkpoint: str, schedule: str,
                 micro_batches: int, **kw: object) -> list[Timeline]:
        assert micro_batches == short_m
        seen["checkpoint"] = in_situ.run_checkpoint(checkpoint, micro_batches)
        one = simulate_config(calib, balance, micro_batches, micro_batches * b, link.link,
                              checkpoint=seen["checkpoint"],
                              schedule=schedule, setup=link.setup, teardown=link.teardown).timeline
        kind_of = {x: kind for kind, xs in in_situ.READ_FROM.items() for x in xs}
        return [Timeline(one.num_stages, [
            Event(e.stage, e.kind, e.microbatch, e.start,
                  e.start + e.duration * (KNOWN[e.stage][kind_of[e.kind]] if e.kind in kind_of else 1.0))
            for e in one.events], {})] * 3

    monkeypatch.setattr(in_situ, "in_situ_timelines", fake_run)
    result = own_model.simulate_model(work, k=k, m=m, microbatch=b, checkpoint=checkpoint, schedule=schedule,
                                      method="flops", link="ideal", repeats=2, validate=False,
                                      in_situ=True, in_situ_microbatches=short_m)
    assert result.in_situ is not None
    expected_kinds = {"forward", "backward", "optimizer_step"} | ({"recompute"} if checkpoint != "never"
                                                                 else set())
    for stage, got in enumerate(result.in_situ["factors"]):
        for kind in expected_kinds:
            assert got[kind] == pytest.approx(KNOWN[stage][kind]), (stage, kind)
    assert seen["checkpoint"] == ("always" if checkpoint == "except_last" and short_m == 1 else checkpoint)

    sched = make_schedule(schedule, k, m, checkpoint, False)
    raw = stage_costs(calib, result.balance, split_sizes(m * b, m), link.setup, link.teardown)
    used = [{kind: KNOWN[s][kind] if kind in expected_kinds else 1.0 for kind in KNOWN[s]} for s in range(k)]
    expected = simulate(sched, scaled(raw, used), link.link, m * b).step_time
    uncorrected = simulate(sched, raw, link.link, m * b).step_time
    assert result.step_time_s == pytest.approx(expected, rel=1e-9)
    assert result.in_situ["uncorrected_step_time_s"] == pytest.approx(uncorrected, rel=1e-9)
    assert abs(expected / uncorrected - 1) > 0.05       # the correction moved it
    # applied to the other stage, the same factors give another figure
    swapped = simulate(sched, scaled(raw, used[::-1]), link.link, m * b).step_time
    assert abs(swapped / expected - 1) > 1e-3


def test_level_factors_sum_every_stage_and_leveled_scales_every_layer_alike() -> None:
    from gpipe_repro.sim.calibration.costs import Calibration, LayerCost
    from gpipe_repro.sim.in_situ import level_factors, leveled

    measured = [_timeline(2.0, 3.0), _timeline(2.2, 3.0), _timeline(1.8, 3.0)]
    # forward: (2 + 2) over (1 + 1); backward: (3 + 6) over (1 + 2)
    assert level_factors(measured, _timeline(1.0, 1.0)) == pytest.approx(
        {"forward": 2.0, "recompute": 1.0, "backward": 3.0, "optimizer_step": 1.0})
    layer = LayerCost(forward=1.0, forward_nograd=0.5, recompute=0.8, backward=2.0, optimizer=0.1,
                      forward_flops=7.0, flops=21.0, params=3, output_bytes=8, grad_bytes=8, accumulate=0.2,
                      backward_input=None, backward_weight=1.5)
    calib = Calibration("w", "time", "cpu", [0, 1], {4: [layer, layer], 8: [layer, layer]},
                        optimizer_call=0.4)
    out = leveled(calib, 4, {"forward": 2.0, "recompute": 1.5, "backward": 3.0, "optimizer_step": 0.5})
    got = out.at(4)[1]
    assert (got.forward, got.forward_nograd, got.recompute) == pytest.approx((2.0, 1.0, 1.2))
    assert (got.backward, got.accumulate, got.backward_weight) == pytest.approx((6.0, 0.6, 4.5))
    assert got.backward_input is None and got.optimizer == pytest.approx(0.05)
    assert (got.flops, got.params, got.output_bytes) == (21.0, 3, 8)       # counted, not timed
    assert out.optimizer_call == pytest.approx(0.2) and out.at(8) == calib.at(8)
    assert calib.at(4)[0].forward == 1.0                                   # the original unchanged
