"""The throughput table within a time limit: in a slow hour `make results` killed it at its 860 s
part limit with nothing written (calibrations 180 s, measured rounds 430 s, then the fixed-mini-batch
calibration past the limit). Its measured rounds now share what the table has left."""
from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from gpipe_repro.cli import app
from gpipe_repro.repro.throughput.measure import AFTER_MEASURING_S, CELL_RULE, round_budget


def test_the_measured_rounds_share_what_the_limit_leaves() -> None:
    assert round_budget(CELL_RULE, None, 500.0, 2) == CELL_RULE
    first = round_budget(CELL_RULE, 820.0, 180.0, 2)
    assert first.budget_s == pytest.approx((820 - 180 - AFTER_MEASURING_S) / 2)
    assert first.max_rounds == CELL_RULE.max_rounds and first.min_rounds == CELL_RULE.min_rounds
    assert round_budget(CELL_RULE, 820.0, 500.0, 1).budget_s == pytest.approx(820 - 500 - AFTER_MEASURING_S)
    assert round_budget(CELL_RULE, 2000.0, 0.0, 1).budget_s == CELL_RULE.budget_s   # never more
    assert round_budget(CELL_RULE, 820.0, 800.0, 1).budget_s == 30.0               # a few rounds


def test_the_command_line_and_make_results_give_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from experiments.results import PARTS
    from gpipe_repro.repro import throughput_table
    seen: list[Any] = []
    monkeypatch.setattr(throughput_table, "main", lambda settings, *a, **k: seen.append(settings))
    result = CliRunner().invoke(app, ["throughput-table", "--time-limit", "700", "--no-wandb"])
    assert result.exit_code == 0, result.output
    assert seen[0].time_limit_s == 700.0
    part = next(p for p in PARTS if p.name == "throughput-table")
    args = list(part.argv)
    assert float(args[args.index("--time-limit") + 1]) < part.limit_s
