"""make validate-unseen: every row counts, with the interval its measured steps give its error."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpipe_repro.models.workload import Workload
from gpipe_repro.repro import validate_unseen as vu


def fake_run(errors: dict[tuple[int, str], tuple[float, float]]) -> Any:
    """A configuration whose measured steps scatter by +-spread around (1 + error) x simulated."""
    def run(workload: Workload, *, k: int, m: int, microbatch: int, checkpoint: str,
            steps: int) -> dict[str, Any]:
        error, spread = errors.get((m, checkpoint), (0.01, 0.0))
        simulated_s = 1.0
        times = [simulated_s * (1 + error + spread * (i % 3 - 1)) for i in range(8)]
        return {"workload": workload.name, "K": k, "M": m, "microbatch": microbatch,
                "checkpoint": checkpoint, "balance": [4, 6], "step_time_s": simulated_s,
                "measured_step_time_s": sorted(times)[4], "measured_step_times_s": times,
                "relative_error": error}
    return run


def test_every_row_counts_and_a_wide_interval_is_inconclusive(tmp_path: Path) -> None:
    errors = {(1, "never"): (0.04, 0.0), (2, "never"): (-0.08, 0.0),
              (4, "never"): (0.02, 0.09)}           # a busy row: a wide interval, still counted
    payload = vu.main(models=["residual MLP 8x1024"], ms=[1, 2, 4], checkpoints=["never"], out=str(tmp_path),
                      command="gpipe-repro validate-unseen --models 'residual MLP 8x1024'",
                      run=fake_run(errors))
    s = payload["summary"]
    assert s["configurations"] == 3
    assert s["median_abs_error"] == pytest.approx(0.04) and s["max_abs_error"] == pytest.approx(0.08)
    # the busy row's interval reaches -7%: the median's upper bound passes 5%
    assert s["median_abs_error_bounds"] == pytest.approx([0.04, 0.07])
    assert s["verdict"] == "inconclusive"
    page = (tmp_path / "validation_unseen.md").read_text()
    assert "inconclusive" in page and "+2.0% [-7.0%" in page
    assert "gpipe-repro validate-unseen --models" in page      # not "make ..."
    assert (tmp_path / "validation_unseen.json").is_file()


def test_micro_batches_under_16_rows_are_outside_the_target() -> None:
    rows = [{"microbatch": 8, "step_time_s": 1.0, "measured_step_time_s": 1.5},
            {"microbatch": 16, "step_time_s": 1.0, "measured_step_times_s": [1.03] * 8,
             "measured_step_time_s": 1.03}]
    s = vu.summarize(rows)
    assert s["configurations"] == 1 and s["verdict"] == "met" and s["met"] is True


def test_bad_micro_batch_counts_are_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="must divide --batch-size 256"):
        vu.main(ms=[3], out=str(tmp_path), run=fake_run({}))
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
