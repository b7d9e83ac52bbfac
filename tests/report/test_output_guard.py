"""The shared rule for files a command writes where it was told (output_guard.check_outputs), the stamps
that tell a command's own files from a user's, and $GPIPE_REPRO_RESULTS for every results writer."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpipe_repro.report import output_guard, provenance
from gpipe_repro.report.output_guard import OutputRefused, check_outputs, owned_json, stamp, written_by
from gpipe_repro.report.records import results_dir, results_root, write_json


def _check(paths: list[Path], **kw: Any) -> None:
    check_outputs(paths, command="fit", option="--out", **{"overwrite": False, **kw})


def test_new_paths_are_fine_and_missing_parents_are_allowed(tmp_path: Path) -> None:
    _check([tmp_path / "a.json", tmp_path / "no" / "such" / "b.json"])


def test_a_users_file_is_refused_even_with_overwrite(tmp_path: Path) -> None:
    mine = tmp_path / "plan.json"
    mine.write_text("my precious\n")
    for overwrite in (False, True):
        with pytest.raises(OutputRefused, match="not a previous `gpipe-repro fit` output"):
            _check([mine], overwrite=overwrite)
    with pytest.raises(OutputRefused, match="not a previous"):
        _check([mine], record=True)                  # not even the make target replaces it
    assert mine.read_text() == "my precious\n"


def test_own_output_needs_overwrite(tmp_path: Path) -> None:
    own = write_json(tmp_path / "plan.json", stamp({"x": 1}, "fit"))
    assert written_by(own) == "fit"
    with pytest.raises(OutputRefused, match="pass --overwrite"):
        _check([own])
    _check([own], overwrite=True)
    _check([own], record=True)                       # the make target: its own output, no flag
    with pytest.raises(OutputRefused, match="not a previous `gpipe-repro plan`"):
        check_outputs([own], command="plan", option="--out", overwrite=True)


def test_directories_and_files_in_the_way_are_refused(tmp_path: Path) -> None:
    with pytest.raises(OutputRefused, match="is a directory"):
        _check([tmp_path])
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputRefused, match="is a file, not a directory"):
        _check([tmp_path / "f" / "plan.json"])


def test_results_of_record_change_only_through_the_make_target(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output_guard, "checkout_results", lambda: tmp_path / "results")
    monkeypatch.setattr(provenance, "changed_files", lambda repo=None: [])      # a clean checkout
    own = write_json(tmp_path / "results" / "throughput" / "t.json", stamp({}, "throughput-table"))
    with pytest.raises(OutputRefused, match="of record.*`make throughput-table`"):
        check_outputs([own], command="throughput-table", option="--out", overwrite=True,
                      make_target="throughput-table")
    check_outputs([own], command="throughput-table", option="--out", overwrite=False,
                  make_target="throughput-table", record=True)
    elsewhere = write_json(tmp_path / "mine" / "t.json", stamp({}, "throughput-table"))
    check_outputs([elsewhere], command="throughput-table", option="--out", overwrite=True)


def _record_writers() -> dict[str, Any]:
    """Every command's check of the results of record it writes with --record (what its make target
    passes), called on a folder: throughput-table, validate-sim, validate-unseen, memory-table."""
    from gpipe_repro.repro import validate_simulator, validate_unseen
    from gpipe_repro.repro.memory_table import experiment as memory_table
    from gpipe_repro.repro.throughput import outputs as throughput_table
    return {"throughput-table": throughput_table.check_out_dir,
            "validate-sim": validate_simulator.check_out_dir,
            "validate-unseen": validate_unseen.check_out_dir, "memory-table": memory_table.check_out_dir}


@pytest.mark.parametrize("command", _record_writers())
def test_results_of_record_were_written_from_a_dirty_checkout(command: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`make throughput-table` (validate-sim, validate-unseen, memory-table) wrote the results of
    record from a checkout whose code differed from the commit their stamps name ("(dirty)"); the
    benchmarks refused it. Every writer of record now refuses before any work, naming the files."""
    monkeypatch.setattr(output_guard, "checkout_results", lambda: tmp_path / "results")
    monkeypatch.setattr(provenance, "changed_files", lambda repo=None: ["gpipe_repro/engine/gpipe.py"])
    check = _record_writers()[command]
    with pytest.raises((OutputRefused, SystemExit), match="only from a clean commit.*engine/gpipe.py"):
        check(tmp_path / "results" / "x", overwrite=False, record=True)
    check(tmp_path / "mine", overwrite=False, record=True)          # elsewhere: any checkout
    monkeypatch.setattr(provenance, "changed_files", lambda repo=None: [])
    check(tmp_path / "results" / "x", overwrite=False, record=True)


def test_legacy_outputs_are_recognized_only_by_their_shape(tmp_path: Path) -> None:
    old = write_json(tmp_path / "old.json", {"table2": {}, "settings": {}})
    assert owned_json(old, "throughput-table", lambda d: "table2" in d)
    assert not owned_json(old, "throughput-table")
    other = write_json(tmp_path / "other.json", stamp({"table2": {}}, "memory-table"))
    assert not owned_json(other, "throughput-table", lambda d: "table2" in d)


def test_a_gantt_png_carries_its_writer(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gpipe_repro.engine.timeline import Timeline
    from gpipe_repro.report.gantt import render_gantt

    stamped = render_gantt(Timeline(2), tmp_path / "g.png", written_by="pipeline")
    plain = render_gantt(Timeline(2), tmp_path / "p.png")
    assert written_by(stamped) == "pipeline"
    assert written_by(plain) is None
    (tmp_path / "x.png").write_bytes(b"not a png")
    assert written_by(tmp_path / "x.png") is None


def test_results_root_honours_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPIPE_REPRO_RESULTS", str(tmp_path / "r"))
    assert results_root() == tmp_path / "r"
    assert results_dir("x") == tmp_path / "r" / "x" and (tmp_path / "r" / "x").is_dir()
    monkeypatch.delenv("GPIPE_REPRO_RESULTS")
    assert results_root() == Path("results")


def test_gpu_check_default_and_probe_default_honour_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from experiments import probe_gpu_microbatches as probe
    from gpipe_repro.repro.gpu_check import default_out_dir

    monkeypatch.setenv("GPIPE_REPRO_RESULTS", str(tmp_path))
    assert default_out_dir("cpu").parent == tmp_path / "gpu"
    path = probe.json_path(probe._DEFAULT, torch.device("cpu"))
    assert path is not None and path.parent.parent == tmp_path / "gpu"


def test_wandb_folders_of_the_tables_honour_the_environment(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_repro.repro.throughput import outputs

    seen: list[Path] = []

    class Logger:
        def __init__(self, *args: Any, dir: Path, **kw: Any) -> None:
            seen.append(Path(dir))

        def __enter__(self) -> Any:
            raise RuntimeError("stop")

        def __exit__(self, *exc: Any) -> None:
            return None

    monkeypatch.setattr(outputs, "RunLogger", Logger)
    monkeypatch.setenv("GPIPE_REPRO_RESULTS", str(tmp_path))
    with pytest.raises(RuntimeError, match="stop"):
        outputs.log_to_wandb({"settings": {}}, [])
    assert seen == [tmp_path / "runs" / "throughput-table"]


def test_a_torn_last_metrics_row_is_left_out_and_a_bad_middle_row_is_named(tmp_path: Path) -> None:
    """A full disk or a power loss can cut the last row of metrics.jsonl; resuming reads the rows
    (read_metrics) and used to fail with a bare JSON error naming neither file nor line."""
    from gpipe_repro.report.wandb_log import read_metrics
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 99, "train/lo')
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    path.write_text('{"step": 1}\n{"step": 2, "tr\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2, is not a JSON row"):
        read_metrics(path)
