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
