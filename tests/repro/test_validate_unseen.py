"""make validate-unseen: the verdict counts clean rows only, and the page marks busy ones."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpipe_repro.models.workload import Workload
from gpipe_repro.repro import validate_unseen as vu

CLEAN = {"idle_fraction_before": 0.97, "others_cpu_fraction_during": 0.02, "load_average_before": 0.1}
BUSY = {"idle_fraction_before": 0.97, "others_cpu_fraction_during": 0.45, "load_average_before": 1.9}


def fake_run(errors: dict[tuple[int, str], tuple[float, dict[str, Any]]]) -> Any:
    def run(workload: Workload, *, k: int, m: int, microbatch: int, checkpoint: str,
            steps: int) -> dict[str, Any]:
        error, host = errors.get((m, checkpoint), (0.01, CLEAN))
        measured_s = 1.0
        return {"workload": workload.name, "K": k, "M": m, "microbatch": microbatch,
                "checkpoint": checkpoint, "balance": [4, 6], "step_time_s": measured_s / (1 + error),
                "measured_step_time_s": measured_s, "relative_error": error, "measured_host": host}
    return run


def test_verdict_from_clean_rows_and_busy_rows_marked(tmp_path: Path) -> None:
    errors = {(1, "never"): (0.04, CLEAN), (2, "never"): (-0.08, CLEAN),
              (4, "never"): (0.30, BUSY)}           # a busy row: shown, marked, not judged
    payload = vu.main(["--models", "residual MLP 8x1024", "--ms", "1", "2", "4",
                       "--checkpoints", "never", "--out", str(tmp_path)], run=fake_run(errors))
    s = payload["summary"]
    assert s["configurations"] == 2 and s["left_out_busy"] == 1
    assert s["median_abs_error"] == pytest.approx(0.06) and s["worst_abs_error"] == pytest.approx(0.08)
    assert s["met"] is False                                   # median 6% > 5%
    page = (tmp_path / "validation_unseen.md").read_text()
    assert "NOT met" in page and "†busy" in page and "other processes 45%" in page
    assert "python -m experiments.validate_unseen --models" in page      # not "make ..."
    assert (tmp_path / "validation_unseen.json").is_file()


def test_micro_batches_under_16_rows_are_outside_the_target() -> None:
    rows = [{"microbatch": 8, "relative_error": 0.5, "measured_host": CLEAN},
            {"microbatch": 16, "relative_error": 0.03, "measured_host": CLEAN}]
    s = vu.summarize(rows)
    assert s["configurations"] == 1 and s["met"] is True


def test_bad_micro_batch_counts_are_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="must divide --batch 256"):
        vu.main(["--ms", "3", "--out", str(tmp_path)], run=fake_run({}))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", list(vu.MODELS))
def test_the_unseen_models_build_as_layer_lists(name: str) -> None:
    factory, shape = vu.MODELS[name]
    work = Workload.create(name, factory, "features", shape, 10)
    layers = work.build("meta")
    assert len(layers) >= 8
    x, _ = work.sample(2, "meta")
    for layer in layers:
        x = layer(x)
    assert tuple(x.shape) == (2, 10)
