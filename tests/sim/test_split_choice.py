"""Choosing a zero-bubble schedule's split count and cut from costs (sim/split_choice.py): the
shortest simulated step of every count on both cuts, ties to fewer splits; where the split costs
more than it fills, few backwards split and the step is no longer than 1F1B's; where it is free,
zero bubble beats 1F1B. Costs are made up; nothing is timed."""
from __future__ import annotations

import pytest

from gpipe_repro.engine.microbatch import split_sizes
from gpipe_repro.engine.schedule import make_schedule
from gpipe_repro.sim.calibration import Calibration, LayerCost
from gpipe_repro.sim.links import PRESETS
from gpipe_repro.sim.partition_choice import choose_cut
from gpipe_repro.sim.simulator import simulate, stage_costs
from gpipe_repro.sim.split_choice import TIE, choose_split

LINK = PRESETS["ideal"]


def _calibration(split_extra: float, layers: int = 8, size: int = 4) -> Calibration:
    """Every layer F = 1 ms, B = 2 ms; the split's I and W each half of B times (1 + split_extra)."""
    half = 1e-3 * (1.0 + split_extra)
    cost = LayerCost(forward=1e-3, forward_nograd=1e-3, recompute=1e-3, backward=2e-3, optimizer=0.0,
                     forward_flops=1.0, flops=3.0, params=1, output_bytes=0, grad_bytes=0,
                     backward_input=half, backward_weight=half)
    return Calibration("synthetic", "time", "synthetic", list(range(layers)), {size: [cost] * layers})


def _one_f_one_b(calib: Calibration, k: int, m: int, checkpoint: str = "never") -> float:
    cut = choose_cut(calib, 4, checkpoint, make_schedule("1f1b", k, k, checkpoint))
    return simulate(make_schedule("1f1b", k, m, checkpoint), stage_costs(calib, cut, split_sizes(4 * m, m)),
                    LINK, 4 * m).step_time


@pytest.mark.parametrize("k,m", [(2, 4), (2, 8), (4, 8)])
def test_a_free_split_pays_and_a_costly_one_is_kept_to_the_last_micro_batches(k: int, m: int) -> None:
    free = choose_split(_calibration(0.0), "zb-h1", k, m, 4, "never", LINK)
    assert free.step_time < _one_f_one_b(_calibration(0.0), k, m) * (1 - 0.02)
    costly = choose_split(_calibration(0.5), "zb-h1", k, m, 4, "never", LINK)
    assert costly.split_backwards < m
    everything = costly.steps[(tuple(costly.balance), m)]
    assert costly.step_time < everything
    assert costly.step_time <= _one_f_one_b(_calibration(0.5), k, m) * (1 + TIE)


def test_the_choice_is_the_shortest_candidate_and_a_tie_goes_to_fewer_splits() -> None:
    choice = choose_split(_calibration(0.2), "zb-v", 2, 8, 4, "except_last", LINK)
    best = min(choice.steps.values())
    assert choice.step_time <= best * (1 + TIE)
    ties = [n for (b, n), t in choice.steps.items() if t <= best * (1 + TIE)]
    assert choice.split_backwards == min(ties)
    assert len(choice.steps) % 9 == 0      # every count 0..8 on each candidate cut
    assert choice.to_json()["split_backwards"] == choice.split_backwards


def test_only_zero_bubble_schedules_have_a_split_to_choose() -> None:
    with pytest.raises(ValueError, match="choose_split is for the zero-bubble schedules"):
        choose_split(_calibration(0.0), "1f1b", 2, 4, 4, "never", LINK)
