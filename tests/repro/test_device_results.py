"""`make device-results` in its tiny CPU mode (what a lent GPU host runs, at toy sizes, K=2 and R=2):
the plan, the files that come back, the stamps, a part that fails, and the output-folder check."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from experiments import device_results as dr
from experiments.result_stamps import read_stamp
from experiments.timed_parts import check_parts

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("device") / "out"
    proc = subprocess.run([sys.executable, "-m", "experiments.device_results", "--tiny"], cwd=REPO,
                          env={**os.environ, "OUT": str(out)}, capture_output=True,
                          text=True, timeout=600)
    return {"out": out, "proc": proc, "summary": json.loads((out / "summary.json").read_text())}


def test_the_full_plan_fits_8_minutes_in_the_order_asked() -> None:
    parts = dr.plan(Path("/scratch"), tiny=False)
    check_parts(parts, dr.PARTS_LIMIT_S)
    assert dr.PARTS_LIMIT_S < dr.TOTAL_LIMIT_S
    assert [p.name for p in parts] == ["host-speed", "gpu-check", "validate-sim-k2", "validate-sim-k4",
                                       "validate-sim-k8", "bench-schedules-k4", "bench-replicas",
                                       "bench-compile"]
    assert all("--tiny" not in p.argv for p in parts)


def test_tiny_mode_runs_every_part_at_k2_and_brings_back_three_stamped_files(
        tiny_run: dict[str, Any]) -> None:
    assert tiny_run["proc"].returncode == 0, tiny_run["proc"].stdout[-3000:]
    out, summary = tiny_run["out"], tiny_run["summary"]
    assert sorted(p.name for p in out.iterdir()) == sorted(dr.FILES) and len(dr.FILES) <= 8
    assert [p["name"] for p in summary["parts"]] == ["host-speed", "gpu-check", "validate-sim-k2",
                                                     "bench-schedules-k2", "bench-replicas"]
    assert all(p["status"] == "ok" for p in summary["parts"])
    assert summary["tiny"] is True and summary["written_by"] == dr.COMMAND
    speed = summary["figures"]["host-speed"]["fast_share"]
    assert 0.0 <= speed["min"] <= speed["mean"] <= speed["max"] <= 1.0
    assert summary["figures"]["validate-sim-k2"]["rows"][0]["K"] == 2
    assert summary["method"].startswith("measured")
    assert summary["figures"]["host-speed"]["method"] == "measured"
    assert "simulated" in summary["figures"]["validate-sim-k2"]["method"]
    assert list(summary["figures"]["bench-replicas"]["results"]) == ["R=2"]
    stamp = read_stamp(out / "summary.json")
    assert stamp is not None and stamp["command"] == dr.COMMAND and stamp["hostname"]
    assert stamp["commit"] == summary["git_commit"]
    assert read_stamp(out / "summary.md") is not None
    with tarfile.open(out / "parts.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"parts/{p['name']}/result.json" for p in summary["parts"]} <= names


def test_a_failing_part_is_recorded_and_the_run_goes_on(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dr, "TINY", (("no-such-part", 30), ("host-speed", 30)))
    summary = dr.device_results(tmp_path / "out", tiny=True)
    assert [(p["name"], p["status"]) for p in summary["parts"]] == [("no-such-part", "failed"),
                                                                    ("host-speed", "ok")]
    assert "host-speed" in summary["figures"]


def test_an_output_folder_with_other_files_is_refused_before_any_work(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="did not write"):
        dr.device_results(tmp_path, tiny=True)
