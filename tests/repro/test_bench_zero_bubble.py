"""bench-zero-bubble: its groups are every model of both validations, and the tiny mode runs end to
end (both zero-bubble rows against 1F1B; no timing judged)."""
from __future__ import annotations

import pytest


@pytest.mark.slow
def test_zero_bubble_tiny_run_gives_both_zero_bubble_rows_against_1f1b(
        capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.bench_zero_bubble import app
    from tests.repro.tiny_runs import tiny_page
    text = tiny_page(app, ["--tiny"], capsys)
    assert "TINY RUN: not of record" in text
    for schedule in ("zb-h1", "zb-v"):
        assert f"| tiny mlp | never      |   2 |     8 | {schedule}" in text


def test_zero_bubble_groups_cover_every_model_of_both_validations() -> None:
    from experiments.bench_zero_bubble import groups
    from gpipe_repro.repro.throughput.workloads import SCALED_WORKLOADS
    from gpipe_repro.repro.validate_unseen import MODELS as UNSEEN

    got = groups({"tiny": False, "ms": [2, 8], "checkpoints": ["never", "always"]})
    assert {g[0] for g in got} == set(SCALED_WORKLOADS) | set(UNSEEN)
    assert len(got) == 4 * (len(SCALED_WORKLOADS) + len(UNSEEN))
    assert ("amoebanet", "always", 8, 32) in got and ("residual MLP 8x1024", "never", 2, 256) in got
