"""make throughput-reproducibility: the page says the verdict, the partitions that flipped and each
run's calibration uncertainty; each run calibrates into a cache of its own; the command refuses a
dirty tree before it runs anything."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from experiments import throughput_reproducibility as module
from experiments.compare_throughput import compare


def table(value: float, balance: list[int], uncertainty: float) -> dict[str, Any]:
    row = {"K": 4, "M": 32, "simulated": {"normalized": value}, "balance": balance}
    return {"table2": {"amoebanet": [row]}, "table3": {},
            "calibration": {"amoebanet": {"method": "time", "device": "cpu",
                                          "uncertainty": {"4": uncertainty}}}}


def test_page_gives_the_verdict_the_flips_and_the_uncertainties() -> None:
    a, b = table(3.50, [6, 6, 5, 7], 0.04), table(3.52, [6, 6, 5, 7], 0.02)
    result = compare(a, b)
    assert module.verdict(result) == "met"
    text = module.page(result, [a, b])
    assert "**0.57%**" in text and "partitions all agree: **met**" in text
    assert "run A: amoebanet at 4 rows 4.0%; run B: amoebanet at 4 rows 2.0%" in text
    c = table(3.75, [7, 6, 5, 6], 0.02)
    flipped = compare(a, c)
    assert module.verdict(flipped) == "not met"
    assert "differ in 1 cells" in module.page(flipped, [a, c])
    assert "NO: [6, 6, 5, 7] vs [7, 6, 5, 6]" in module.page(flipped, [a, c])


def test_each_run_calibrates_into_its_own_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[list[str], str]] = []

    def run(cmd: list[str], env: dict[str, str], check: bool) -> None:
        calls.append((cmd, env["GPIPE_REPRO_CACHE"]))
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        from gpipe_repro.report.records import write_json
        write_json(out / "throughput_table.json", table(3.5, [6, 6, 5, 7], 0.01))
    monkeypatch.setattr(module, "subprocess", SimpleNamespace(run=run))
    first = module.run_table(tmp_path / "A", tmp_path / "cache-A", None)
    second = module.run_table(tmp_path / "B", tmp_path / "cache-B", tmp_path / "A" / "throughput_table.json")
    assert first == second
    assert [c for _, c in calls] == [str(tmp_path / "cache-A"), str(tmp_path / "cache-B")]
    assert all("--no-measure" in cmd and "experiments.throughput_table" in cmd for cmd, _ in calls)
    assert "--fresh-cuts" in calls[0][0]
    assert calls[1][0][calls[1][0].index("--cuts-from") + 1] == str(tmp_path / "A" / "throughput_table.json")


def test_refuses_a_dirty_tree_before_running(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPIPE_REPRO_RESULTS", raising=False)
    monkeypatch.setattr("gpipe_repro.report.provenance.changed_files",
                        lambda: ["gpipe_repro/engine/gpipe.py"])
    monkeypatch.setattr(module, "run_table", lambda *a: pytest.fail("ran before the check"))
    with pytest.raises(SystemExit, match="only from a clean commit"):
        module.main()


def test_silent_self_comparison_each_run_calibrates_into_a_cache_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe the docs gave ran both tables on one calibration cache, so the second run read the
    first one's costs and the two always agreed: each run gets a cache of its own."""
    caches: list[Path] = []
    kept_from: list[Path | None] = []

    def run_table(out: Path, cache: Path, cuts_from: Path | None) -> dict[str, Any]:
        caches.append(cache)
        kept_from.append(cuts_from)
        return table(3.5, [6, 6, 5, 7], 0.01)
    published: list[dict[str, Any]] = []
    monkeypatch.setattr(module, "check_publish", lambda *a, **k: None)
    monkeypatch.setattr(module, "run_table", run_table)
    monkeypatch.setattr(module, "publish", lambda _e, _s, payload, _t, **k: published.append(payload))
    module.main()
    assert len(caches) == 2 and caches[0] != caches[1]
    assert published[0]["verdict"] == "met" and published[0]["method"].startswith("simulated")
    # as two consecutive `make throughput-table` runs: A keeps the record's cuts, B those of A
    assert kept_from[0] == module.RECORD and kept_from[1] is not None and kept_from[1].parent.name == "A"


def test_a_cell_in_one_run_only_is_not_reproduced() -> None:
    a = table(3.5, [6, 6, 5, 7], 0.01)
    b = table(3.5, [6, 6, 5, 7], 0.01)
    b["table2"]["transformer"] = [{"K": 2, "M": 4, "simulated": {"normalized": 1.6}, "balance": [25, 25]}]
    result = compare(a, b)
    assert module.verdict(result) == "not met"
    assert "Cells in one run only" in module.page(result, [a, b])
