"""`gpipe-repro throughput` says which cut it simulates and how GPipe's default cut of the same
model compares, with a sample and without one, each simulated with the same calibration."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpipe_repro.cli import app

# Layer 0 holds most of the parameters but costs no time (a frozen table): balancing parameters
# puts it alone in the first cell, balancing time gives each cell two layers of work.
MODEL = '''
import torch
from torch import nn


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(200_000), requires_grad=False)

    def forward(self, x):
        return x + self.table[0]


def model():
    return [Table()] + [nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
                        for _ in range(3)]
'''


def test_throughput_names_its_cut_and_gpipes_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cut_model_for_test.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("GPIPE_REPRO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "throughput.json"
    result = CliRunner().invoke(app, ["throughput", "--model", "cut_model_for_test:model", "--input-shape",
                                      "64", "--classes", "64", "--k", "2", "--m", "4", "--microbatch",
                                      "16", "--method", "flops", "--link", "ideal", "--no-validate",
                                      "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    line = next(x for x in result.output.splitlines() if "cut:" in x)
    assert "cut: simulating [2, 2] (balanced by FLOP-estimated time); GPipe's default for this model " \
           "with sample= a micro-batch of 16 is [" in line
    assert "(by measured time" in line               # the engine's default with a sample
    assert "without a sample [1, 3] (by parameters: simulated " in line and line.endswith("x slower)")
    cuts = json.loads(out.read_text())["cuts"]
    assert cuts["simulated"] == [2, 2] and cuts["without_sample"] == [1, 3]
    assert cuts["with_sample_by"] == "time" and cuts["without_sample_by"] == "params"
    assert cuts["without_sample_step_ratio"] > 1


@pytest.mark.parametrize("option", [["--device", "tpu"], ["--algorithm", "x"], ["--devices-per-host", "3"]])
def test_replica_options_without_replicas_were_ignored(option: list[str]) -> None:
    """`throughput --model ... --device tpu` (or --algorithm, --devices-per-host: options of
    --replicas) exited 0 having ignored them, a bad value included."""
    result = CliRunner().invoke(app, ["throughput", "--model", "gpipe_repro.models.mlp:synthetic_mlp",
                                      "--k", "2", "--m", "4", *option])
    assert result.exit_code == 2 and "options of --replicas R" in " ".join(result.output.split())
