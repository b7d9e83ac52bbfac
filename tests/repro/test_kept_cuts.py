"""The throughput table keeps the cuts of the table it replaces where its fresh costs cannot tell them
from their best: which earlier cuts apply, the rows that say so, and the command line's choice of
the earlier table (checked before any work)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpipe_repro.cli import app
from gpipe_repro.report.records import write_json
from gpipe_repro.repro.throughput.kept_cuts import cuts_of
from gpipe_repro.repro.throughput.report import kept_cuts_note
from gpipe_repro.repro.throughput.rows import simulate_rows
from gpipe_repro.repro.throughput.settings import SweepSettings
from gpipe_repro.sim.calibration import Calibration, LayerCost
from gpipe_repro.sim.platform import platform_for

SETTINGS = SweepSettings(link="ideal", measure=False)


def previous(balance: list[int], *, workload: str = "net", checkpoint: str = "always") -> dict[str, Any]:
    return {"settings": {"checkpoint": checkpoint, "objective": "bottleneck"},
            "workloads": {"table2": {"mlp": workload}},
            "table2": {"mlp": [{"K": 2, "M": 4, "microbatch": 4, "balance": balance},
                               {"K": 2, "M": 1, "microbatch": "?", "balance": balance}]},
            "table3": {}}


def test_earlier_cuts_apply_only_to_the_same_workload_remat_and_objective() -> None:
    assert cuts_of(previous([1, 2]), "table2", "mlp", "net", SETTINGS) == {(2, 4, 4): [1, 2]}
    assert cuts_of(previous([1, 2], workload="other"), "table2", "mlp", "net", SETTINGS) == {}
    assert cuts_of(previous([1, 2], checkpoint="never"), "table2", "mlp", "net", SETTINGS) == {}
    assert cuts_of(previous([1, 2]), "table3", "mlp", "net", SETTINGS) == {}
    assert cuts_of(None, "table2", "mlp", "net", SETTINGS) == {}


def _calibration(costs: list[float], uncertainty: float) -> Calibration:
    layers = [LayerCost(forward=c / 3, forward_nograd=c / 3, recompute=0.0, backward=2 * c / 3,
                        optimizer=0.0, forward_flops=0.0, flops=0.0, params=0, output_bytes=0,
                        grad_bytes=0) for c in costs]
    calib = Calibration("net", "time", "cpu", list(range(len(costs))), {4: layers}, 0.0)
    return replace(calib, uncertainty={4: uncertainty})


def test_rows_keep_an_earlier_cut_among_the_ties_and_say_so() -> None:
    """[1, 2] costs 3.05 at the bottleneck against the best [2, 1]'s 3.01: within the band a kept cut
    may stay in, so an earlier [1, 2] is kept (the row says so, and by how much its bottleneck
    exceeds the best); without it the tie-break chooses."""
    calib = _calibration([3.0, 0.05, 2.96], 0.02)
    settings = replace(SETTINGS, checkpoint="never", ks=(2,), ms=(4,), microbatch=(("mlp", 4),))
    plat = platform_for("ideal")

    def row(keep: dict[tuple[int, int, int], list[int]] | None) -> Any:
        return simulate_rows("mlp", calib, settings, plat, [2], [4], base=(2, 4), keep=keep)[0]
    fresh = row(None)
    other = [1, 2] if fresh.balance == [2, 1] else [2, 1]
    kept = row({(2, 4, 4): other})
    assert (kept.balance, kept.cut_kept, fresh.cut_kept) == (other, True, False)
    excess = {round(kept.bottleneck_excess, 4), round(fresh.bottleneck_excess, 4)}
    assert excess == {0.0, round(3.05 / 3.01 - 1, 4)}
    assert row({(2, 4, 8): other}).balance == fresh.balance       # another micro-batch size: not it
    far = _calibration([3.0, 0.5, 2.0], 0.02)                     # [2, 1] 17% slower: replaced
    out = simulate_rows("mlp", far, settings, plat, [2], [4], base=(2, 4), keep={(2, 4, 4): [2, 1]})[0]
    assert (out.balance, out.cut_kept) == ([1, 2], False)


def test_the_page_says_where_the_cuts_came_from() -> None:
    rows = [{"cut_kept": True, "bottleneck_excess": 0.012}, {"cut_kept": False, "bottleneck_excess": 0.02}]
    note = kept_cuts_note({"cuts_from": "results/throughput/throughput_table.json",
                           "table2": {"mlp": rows}, "table3": {}})
    assert "`results/throughput/throughput_table.json`" in note
    assert "(1 of 2 cells kept, the largest bottleneck 1.2% above the best of these costs)" in note
    assert "every cut chosen afresh" in kept_cuts_note({"cuts_from": None})


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    from gpipe_repro.repro import throughput_table
    seen: list[Any] = []

    def run(*args: Any, **kw: Any) -> None:
        seen.append(kw.get("cuts_from"))
    monkeypatch.setattr(throughput_table, "run_with_progress", run)
    return seen


def _invoke(args: list[str]) -> Any:
    return CliRunner().invoke(app, ["throughput-table", "--no-measure", "--no-wandb", *args],
                              terminal_width=400)


def test_the_earlier_table_is_checked_before_any_work(no_work: list[Any], tmp_path: Path) -> None:
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    for args, says in ((["--cuts-from", str(tmp_path / "missing.json")], "cannot read a throughput table"),
                       (["--cuts-from", str(tmp_path / "notes.json")], "is not a throughput table"),
                       (["--cuts-from", str(tmp_path / "notes.json"), "--fresh-cuts"], "contradict")):
        result = _invoke(["--out", str(tmp_path / "out"), *args])
        assert result.exit_code == 2 and says in " ".join(result.output.replace("│", " ").split()), \
            result.output
    assert no_work == []


def test_by_default_the_cuts_of_the_table_it_replaces(no_work: list[Any], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _invoke(["--out", str(out)]).exit_code == 0          # nothing to replace: afresh
    write_json(out / "throughput_table.json", {"table2": {}, "table3": {}, "settings": {},
                                               "written_by": "throughput-table"})
    assert _invoke(["--out", str(out), "--overwrite"]).exit_code == 0
    assert _invoke(["--out", str(out), "--overwrite", "--fresh-cuts"]).exit_code == 0
    given = tmp_path / "earlier.json"
    write_json(given, {"table2": {}, "table3": {}, "settings": {}})
    assert _invoke(["--out", str(out), "--overwrite", "--cuts-from", str(given)]).exit_code == 0
    assert no_work == [None, out / "throughput_table.json", None, given]
