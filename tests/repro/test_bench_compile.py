"""bench-compile end to end in its tiny mode (aot_eager, the smallest models, 2 rounds per group):
every group is measured and judged, and the page and its JSON are written where asked. No timing
is judged."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner


def test_bench_compile_runs_in_its_tiny_mode_and_writes_where_asked(tmp_path: Path) -> None:
    from experiments import bench_compile

    result = CliRunner().invoke(bench_compile.app, ["--tiny", "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "bench_compile.json").read_text())
    page = (tmp_path / "bench_compile.md").read_text()
    assert payload["method"] == "measured" and payload["config"]["backend"] == "aot_eager"
    assert set(payload["groups"]) == {"mlp", "transformer", "launch", "activation", "sync"}
    for name, group in payload["groups"].items():
        measurement = group["measurement"]
        assert measurement["rounds"] == 2, name
        assert set(group["warm_up"]) == set(measurement["times"]) == set(group["labels"]), name
        assert all(w["steps"] >= 1 for w in group["warm_up"].values()), name
    speedup = payload["groups"]["mlp"]["measurement"]["figures"]
    assert any(f.get("target") == 1.0 for f in speedup.values())
    assert "(measured)" in page and "commit" in page and "load average" in page
    assert "(>= 1.00)" in page and "not comparable" not in page
    assert "sync=False / plain step" in page
    assert "ReLU alone: compiled / eager" in page


def test_bench_compile_refuses_an_unknown_device() -> None:
    from experiments import bench_compile

    result = CliRunner().invoke(bench_compile.app, ["--tiny", "--no-write", "--device", "tpu"])
    assert result.exit_code != 0 and "cpu or cuda" in result.output


def test_a_fresh_compile_cache_is_a_directory_of_its_own_for_the_run_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from experiments.bench_compile import compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    with compile_cache(True) as where:
        assert where is not None and os.path.isdir(where)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == where
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else" and not os.path.exists(where)
    with compile_cache(False) as where:
        assert where is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"
