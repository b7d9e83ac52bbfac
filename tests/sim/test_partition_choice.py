"""The partition choice on measured costs: exact, and stable under the calibration's noise where the
costs leave a margin (gpipe_repro/sim/partition_choice.py says why no rounding grid)."""
from __future__ import annotations

import math
import random

import pytest

from gpipe_repro.engine.partition import cell_costs, partition
from gpipe_repro.sim.partition_choice import TIE_FLOOR, choose_partition, tie_break

# A calibration of the throughput table's scaled AmoebaNet-D (18, 64) at 4-row micro-batches on
# this project's 2-core host (checkpointed forward + recompute + backward + accumulation, seconds
# per layer, as a calibration gives them), and its groups of identical layers (which the
# calibration gives one pooled cost).
AMOEBANET_COSTS = [ms * 1e-3 for ms in [
    1.858, 6.584, 6.012, 7.244, 6.783, 6.63, 6.63, 6.63, 6.63, 6.939, 9.733, 9.595,
    10.01, 10.01, 10.01, 10.01, 11.188, 9.289, 8.751, 8.875, 8.875, 8.875, 8.875, 0.921]]
AMOEBANET_GROUPS = [0, 1, 2, 3, 4, 5, 5, 5, 5, 6, 7, 8, 9, 9, 9, 9, 10, 11, 12, 13, 13, 13, 13, 14]


def _noisy(rng: random.Random, sigma: float) -> list[float]:
    """One more calibration: every group's cost off by a log-normal factor (pooled layers share it)."""
    factor = [math.exp(rng.gauss(0.0, sigma)) for _ in range(max(AMOEBANET_GROUPS) + 1)]
    return [c * factor[g] for c, g in zip(AMOEBANET_COSTS, AMOEBANET_GROUPS)]


@pytest.mark.parametrize("k", [2, 4, 8])
def test_choice_is_the_exact_optimum(k: int) -> None:
    assert choose_partition(AMOEBANET_COSTS, k) == partition(AMOEBANET_COSTS, k)
    assert choose_partition(AMOEBANET_COSTS, k, "variance") == partition(AMOEBANET_COSTS, k, "variance")


@pytest.mark.parametrize("k", [4, 8])
def test_two_calibrations_1_percent_apart_choose_the_same_cut(k: int) -> None:
    """With 1% noise per group the cut never flips in 100 seeded pairs (a 5% rounding grid flipped
    8 of 100 at K=8: each layer near a grid boundary is a discontinuity of its own)."""
    rng = random.Random(0)
    flips = sum(choose_partition(_noisy(rng, 0.01), k) != choose_partition(_noisy(rng, 0.01), k)
                for _ in range(100))
    assert flips == 0


def test_identical_layers_are_exact_ties_broken_the_same_way() -> None:
    """Pooled identical layers (the Transformer's blocks) give the same cut on every calibration,
    whatever the pooled value."""
    for block in (1.0, 1.37, 2.9):
        costs = [0.6] + [block] * 48 + [0.8]
        assert choose_partition(costs, 2) == choose_partition(list(costs), 2) == \
            choose_partition([0.6] + [block * 1.01] * 48 + [0.8], 2)
        assert max(cell_costs(costs, choose_partition(costs, 4))) <= \
            max(cell_costs(costs, partition(costs, 4))) * (1 + 1e-12)


def test_within_the_calibrations_uncertainty_the_most_even_then_smallest_cut_wins() -> None:
    costs = [1.0, 1.0, 1.0, 1.02, 0.98, 1.0]
    exact = choose_partition(costs, 2)
    assert choose_partition(costs, 2, uncertainty=0.0) == exact
    assert choose_partition(costs, 2, uncertainty=0.05) == [3, 3]
    # uneven costs: [3, 1] and [2, 2] are within 10% of the optimum [3, 1]: [2, 2] is more even
    assert choose_partition([1.0, 1.0, 1.0, 3.1], 2) == [3, 1]
    assert choose_partition([1.0, 1.0, 1.0, 3.1], 2, uncertainty=0.0) == [3, 1]
    assert choose_partition([1.0, 1.0, 1.1, 2.0], 2, uncertainty=0.06) == [2, 2]
    # equally even: the lexicographically smallest
    assert tie_break([1.0, 1.0, 1.0], 2, 2.0) == [1, 2]


def test_tie_break_is_the_brute_force_choice() -> None:
    from itertools import combinations

    rng = random.Random(0)
    for _ in range(30):
        n, k = rng.randint(3, 9), rng.randint(2, 4)
        if k > n:
            continue
        costs = [rng.uniform(0.5, 2.0) for _ in range(n)]
        limit = max(cell_costs(costs, partition(costs, k))) * 1.1
        cuts = [[b - a for a, b in zip((0, *c), (*c, n))] for c in combinations(range(1, n), k - 1)]
        within = [b for b in cuts if max(cell_costs(costs, b)) <= limit]
        assert tie_break(costs, k, limit) == min(within, key=lambda b: (sum(x * x for x in b), b))


def test_uncertainty_must_be_a_relative_half_width() -> None:
    with pytest.raises(ValueError, match="uncertainty"):
        choose_partition([1.0, 1.0], 2, uncertainty=-0.1)
    with pytest.raises(ValueError, match="limit"):
        tie_break([1.0, 3.0], 2, 1.0)


def test_silent_flip_two_calibrations_tie_within_one_window_not_each_their_own() -> None:
    """Two runs of the table whose calibrations ended at 1.0% and 1.4% uncertainty, on costs where a
    more even cut lies 1.2% above the optimum: with each run's own uncertainty as its window, one
    run took the optimum and the other the even cut, and every cell of that model differed. The
    window is never narrower than TIE_FLOOR, so both take the even cut; above the floor a run's own
    uncertainty still widens it."""
    costs = [0.33, 0.33, 0.328, 0.012, 0.5, 0.5]     # optimum [4, 2] (1.0), even cut [3, 3] (1.012)
    best = partition(costs, 2)
    even_gap = max(cell_costs(costs, [3, 3])) / max(cell_costs(costs, best)) - 1
    assert best == [4, 2] and 0.010 < even_gap < 0.014
    assert choose_partition(costs, 2, uncertainty=0.010) == [3, 3]
    assert choose_partition(costs, 2, uncertainty=0.014) == [3, 3]
    assert TIE_FLOOR == 0.02
    wide = [0.33, 0.33, 0.305, 0.035, 0.5, 0.5]       # even cut [3, 3] 3.5% above the optimum
    assert choose_partition(wide, 2, uncertainty=0.01) == partition(wide, 2)
    assert choose_partition(wide, 2, uncertainty=0.05) == [3, 3]
