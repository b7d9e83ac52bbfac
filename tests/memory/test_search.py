"""Table 1's searches: bisection helpers, model runs, and the Transformer reproduction."""
from __future__ import annotations

import pytest
import torch

from gpipe_repro.memory.planner import GiB
from gpipe_repro.memory.profile import ProfileCache
from gpipe_repro.memory.search import (
    Row,
    amoebanet_runs,
    largest,
    largest_fitting,
    search_transformer,
    transformer_planner,
)
from gpipe_repro.models.signature import compress, layer_key
from gpipe_repro.paper import TABLE1_TRANSFORMER


@pytest.mark.parametrize("answer", [1, 7, 50, 99, 100])
def test_largest_is_exact(answer: int) -> None:
    calls = []

    def fits(x: int) -> bool:
        calls.append(x)
        return x <= answer
    assert largest(1, 100, fits) == answer
    assert len(calls) <= 9
    assert largest(answer + 1, 200, fits) is None


@pytest.mark.parametrize("budget", [50.0, 1234.5, 9000.0])
def test_largest_fitting_interpolates_a_quadratic(budget: float) -> None:
    calls = []

    def peak(x: int) -> float:
        calls.append(x)
        return 0.7 * x * x + 3 * x + 5
    expected = max(x for x in range(1, 257) if peak(x) <= budget)
    calls.clear()
    assert largest_fitting(1, 256, peak, budget, guesses=(16, 32)) == expected
    assert len(set(calls)) <= 7                    # bisection alone would need ~8 plus guesses


def test_amoebanet_runs_equal_the_built_model() -> None:
    from gpipe_repro.models.amoebanet import amoebanet
    with torch.device("meta"):
        full = compress(list(amoebanet(18, 32)))
    runs = amoebanet_runs(18, 32)
    assert [r.count for r in runs] == [r.count for r in full]
    assert [layer_key(r.layer) for r in runs] == [layer_key(r.layer) for r in full]


def test_transformer_pipeline1_row() -> None:
    """The largest L fits, L + 1 does not, and it is the paper's within 20% (Table 1: 13)."""
    cache = ProfileCache()
    budget = TABLE1_TRANSFORMER["device_memory_gb"] * GiB
    row = Row.pipeline(1, 8)
    found = search_transformer(row, budget, cache)
    assert found.size is not None and found.plan is not None
    L = found.size[0]
    assert found.plan.fits(budget)
    assert not transformer_planner(L + 1, cache).plan(1, 8).fits(budget)
    paper = TABLE1_TRANSFORMER["rows"]["Pipeline-1"]["L"]
    assert abs(L - paper) <= 0.2 * paper
    assert abs(found.plan.parameters - TABLE1_TRANSFORMER["rows"]["Pipeline-1"]["params"]) < 0.2 * 785.8e6
    assert len(found.tried) <= 12                  # bisection, not a scan
