"""`gpipe-repro throughput --in-situ`: its options are checked before any work, and it prints and
writes the uncorrected and the corrected simulated step, the factors and each one's error with its
interval."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpipe_repro.cli import app
from gpipe_repro.sim.own_model import OwnModelResult


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "in_situ_model.py").write_text(textwrap.dedent("""
        from torch import nn
        def layers():
            return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "in_situ_model:layers"


def _no_work(*args: Any, **kw: Any) -> Any:
    raise AssertionError("the work started before the options were checked")


def _invoke(args: list[str]) -> Any:
    return CliRunner().invoke(app, args, terminal_width=400)


def _says(result: Any, text: str) -> None:
    assert result.exit_code == 2, (result.output, result.exception)
    assert text in " ".join(result.output.replace("│", " ").split()), result.output


BASE = ["throughput", "--input-shape", "32", "--m", "4", "--microbatch", "16"]


def test_in_situ_needs_a_core_per_stage(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_repro.report import host
    from gpipe_repro.repro import simulate_model
    monkeypatch.setattr(host, "usable_cores", lambda: 1)
    monkeypatch.setattr(simulate_model, "simulate_model", _no_work)
    monkeypatch.setattr(simulate_model, "preflight", _no_work)
    _says(_invoke([*BASE, "--model", model, "--k", "2", "--in-situ"]),
          "--in-situ runs K=2 stage processes on one core each, but this host has 1 usable core(s): "
          "use --k 1 or less, or drop --in-situ")


@pytest.mark.parametrize("flag", ["--in-situ-steps", "--in-situ-m"])
def test_in_situ_counts_must_be_positive(model: str, monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    from gpipe_repro.repro import simulate_model
    monkeypatch.setattr(simulate_model, "simulate_model", _no_work)
    _says(_invoke([*BASE, "--model", model, "--k", "2", "--in-situ", flag, "0"]), f"{flag} must be >= 1")


def test_in_situ_is_for_your_own_model_not_replicas() -> None:
    _says(_invoke(["throughput", "--replicas", "2", "--in-situ"]), "--in-situ: your own model's options")


def _result(**kw: Any) -> OwnModelResult:
    """A corrected result: uncorrected 100 ms, corrected 110 ms, measured steps around 112 ms."""
    result = OwnModelResult("in_situ_model:layers", 2, 4, 16, "except_last", False, [2, 1], 0.110,
                            64 / 0.110, 0.2, 1.8, 0.2, measured_step_time_s=0.112,
                            measured_step_times_s=[0.110, 0.111, 0.112, 0.113, 0.114],
                            relative_error=0.112 / 0.110 - 1)
    result.in_situ = {"uncorrected_step_time_s": 0.100, "uncorrected_throughput": 640.0,
                      "uncorrected_bubble_fraction": 0.2, "uncorrected_relative_error": 0.12,
                      "factors": [
                          {"forward": 1.05, "recompute": 1.10, "backward": 1.15, "optimizer_step": 1.0},
                          {"forward": 1.20, "recompute": 1.0, "backward": 1.25, "optimizer_step": 1.0}],
                      "run": "a separate run: M=1, 3 steps after 1 warm-up, checkpoint always"}
    return result


def test_in_situ_prints_and_writes_both_figures(model: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_repro.report import host
    from gpipe_repro.repro import simulate_model
    given: dict[str, Any] = {}

    def fake(workload: Any, **kw: Any) -> OwnModelResult:
        given.update(kw)
        return _result()
    monkeypatch.setattr(host, "usable_cores", lambda: 2)
    monkeypatch.setattr(simulate_model, "simulate_model", fake)
    monkeypatch.setattr(simulate_model, "compare_cuts", lambda *a: ("cut: [2, 1]", {}))
    out = tmp_path / "r.json"
    result = _invoke([*BASE, "--model", model, "--k", "2", "--validate", "--in-situ", "--in-situ-steps", "5",
                      "--in-situ-m", "2", "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert given["in_situ"] is True and given["in_situ_steps"] == 5 and given["validate"] is True
    assert given["in_situ_microbatches"] == 2
    text = result.output
    assert "simulated step, uncorrected: 100.0 ms" in text
    assert "simulated step, in-situ corrected: 110.0 ms" in text
    assert "stage 0: forward 1.05, recompute 1.10, backward 1.15" in text
    assert "stage 1: forward 1.20" in text
    # each error with its interval: the measured steps against 100 ms and against 110 ms
    assert "uncorrected +12.0% [+10.0%, +14.0%]" in text
    assert "in-situ corrected +1.8% [+0.0%, +3.6%]" in text
    written = json.loads(out.read_text())
    assert written["errors"]["uncorrected"]["value"] == pytest.approx(0.12)
    assert written["errors"]["in_situ_corrected"]["value"] == pytest.approx(0.112 / 0.110 - 1)
    assert written["errors"]["in_situ_corrected"]["low"] == pytest.approx(0.0)
    assert written["in_situ"]["factors"][1]["backward"] == 1.25


def test_without_in_situ_the_error_has_its_interval_and_no_correction() -> None:
    result = _result()
    result.in_situ = None
    text = result.describe()
    assert "corrected" not in text and "simulator error +1.8% [+0.0%, +3.6%]" in text
    assert result.error(corrected=False) is not None
