"""Table 1 records and their rendering: ours beside the paper's, figures written."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpipe_repro.memory.planner import MemoryPlanner
from gpipe_repro.memory.scaling import activation_grid, fit_paper_model
from gpipe_repro.memory.search import Found, Row
from gpipe_repro.repro.memory_table.report import plot_activation_grid, plot_max_params, table1_markdown
from gpipe_repro.repro.memory_table.table1 import add_ratios, row_record


def _planner() -> MemoryPlanner:
    from gpipe_repro.models.transformer_lm import lm_loss, transformer_lm
    with torch.device("meta"):
        layers = list(transformer_lm(4, d_model=64, d_ff=128, num_heads=4, vocab_size=200))
    ids = torch.empty(8, 16, dtype=torch.long, device="meta")
    return MemoryPlanner(layers, ids, ids, lm_loss)


def test_records_render_beside_the_paper(tmp_path: Path) -> None:
    planner = _planner()
    rows = []
    for row, paper in ((Row.naive(), {"L": 3, "params": 1e6}),
                       (Row.pipeline(2, 4), {"L": 13, "params": 4e6})):
        plan = planner.plan(row.partitions, row.micro_batches, row.checkpoint)
        rows.append(row_record(Found(row, (4,), plan), paper, ("L",)))
    add_ratios(rows)
    assert rows[1]["ratio_to_naive"]["value"] == 1.0 and rows[1]["ratio_to_naive"]["paper"] == 4.0
    assert all(r["params"]["method"] == "simulated" for r in rows)
    state = planner.plan(2, 4).state_memory            # weights + grads + RMSProp slot (+ step counters)
    assert abs(rows[1]["param_memory_gib"]["value"] * 2 ** 30 - state) < 1
    assert 12 <= state / planner.parameters < 12.1
    md = table1_markdown(rows, ["L"])
    assert "4* (paper 13)" in md and "Pipeline-2" in md
    png = plot_max_params({"Transformer": rows}, tmp_path / "p.png")
    assert png.stat().st_size > 1000
    grid = activation_grid(planner, (1, 2), (1, 2, 4))
    png = plot_activation_grid(grid, fit_paper_model(grid), tmp_path / "a.png", "t")
    assert png.stat().st_size > 1000


def test_make_memory_table_runs_the_memory_table_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make memory-table` runs experiments/memory_table.py: `gpipe-repro memory-table --record`."""
    import runpy

    import gpipe_repro.repro.memory_table as table
    seen: list[dict] = []
    monkeypatch.setattr(table, "main", lambda **kw: seen.append(kw))
    monkeypatch.setattr("sys.argv", ["memory_table", "--m", "4"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("experiments.memory_table", run_name="__main__")
    assert exit_.value.code == 0 and seen and seen[0]["record"] and seen[0]["micro_batches"] == 4
