"""The GPU micro-batch probe's JSON record, on the CPU with the timings stubbed (no model is timed)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from experiments import probe_gpu_microbatches as probe
from gpipe_repro.report.provenance import git_state
from gpipe_repro.report.records import read_json

ROWS = {"plain, full batch": 0.010, "plain, 4 micro-batches accumulated": 0.040,
        "GPipe K=1 M=4 checkpoint=never": 0.050}


def test_the_record_says_measured_device_torch_commit_load_and_rows() -> None:
    rec = probe.payload(ROWS, device=torch.device("cpu"), m=4, config={"batch": 8},
                        load_before=(1.0, 2.0, 3.0), load_after=(1.5, 2.0, 3.0))
    assert rec["method"] == "measured" and rec["experiment"] == "probe-gpu-microbatches"
    assert rec["torch"] == torch.__version__ and rec["commit"] == git_state()["git_commit"]
    assert isinstance(rec["device"], str) and rec["device"]
    assert rec["host"] == {"load_average_before": [1.0, 2.0, 3.0], "load_average_after": [1.5, 2.0, 3.0]}
    assert rec["baseline"] == "plain, 4 micro-batches accumulated"
    # ratios to the baseline row, by hand: 10/40, 40/40, 50/40
    assert [(r["configuration"], round(r["ms_per_step"], 6), round(r["vs_baseline"], 6))
            for r in rec["rows"]] == [("plain, full batch", 10.0, 0.25),
                                      ("plain, 4 micro-batches accumulated", 40.0, 1.0),
                                      ("GPipe K=1 M=4 checkpoint=never", 50.0, 1.25)]


def test_json_goes_where_asked_and_by_default_under_results_gpu_device(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    assert probe.json_path(None, cpu) is None
    assert probe.json_path(str(tmp_path / "x.json"), cpu) == tmp_path / "x.json"
    default = probe.json_path(probe._DEFAULT, cpu, root=tmp_path)
    assert default is not None and default.name == "probe_gpu_microbatches.json"
    assert default.parent.parent == tmp_path / "gpu" and default.parent.name.startswith("cpu-")


def _stub_measure(monkeypatch: pytest.MonkeyPatch, calls: list[Any]) -> None:
    def fake(device: torch.device, **kw: Any) -> dict[str, float]:
        calls.append(kw)
        return {"plain, full batch": 0.01, f"plain, {kw['m']} micro-batches accumulated": 0.02}
    monkeypatch.setattr(probe, "measure", fake)


def test_main_prints_the_table_and_writes_the_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[Any] = []
    _stub_measure(monkeypatch, calls)
    out = tmp_path / "sub" / "probe.json"
    result = CliRunner().invoke(probe.app, ["--device", "cpu", "--batch-size", "4", "--m", "2", "--steps",
                                            "1", "--warmup", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert calls == [{"batch": 4, "m": 2, "steps": 1, "warmup": 0}]
    printed = result.output
    assert "vs plain M=2" in printed and f"wrote {out}" in printed
    rec = read_json(out)
    assert rec["method"] == "measured" and rec["config"]["device"] == "cpu"
    assert [r["vs_baseline"] for r in rec["rows"]] == [0.5, 1.0]
    assert "environment" in rec


def test_an_existing_file_is_refused_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    _stub_measure(monkeypatch, calls)
    out = tmp_path / "probe.json"
    out.write_text("mine\n")
    result = CliRunner().invoke(probe.app, ["--device", "cpu", "--out", str(out)])
    assert result.exit_code == 1 and "exists: pass --overwrite" in result.output
    assert calls == [] and out.read_text() == "mine\n"
    result = CliRunner().invoke(probe.app, ["--device", "cpu", "--out", str(tmp_path)])
    assert result.exit_code == 1 and "is a directory" in result.output
    result = CliRunner().invoke(probe.app, ["--device", "cpu", "--batch-size", "2", "--m", "2", "--out",
                                            str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert read_json(out)["method"] == "measured"
