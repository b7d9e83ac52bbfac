"""Results files: atomic writes that survive crashes, records, markdown, environment, the run logger."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpipe_repro.report import records as results
from gpipe_repro.report.provenance import environment
from gpipe_repro.report.records import (
    Result,
    atomic_write,
    format_record,
    markdown_table,
    measured,
    read_json,
    simulated,
    write_json,
    write_markdown,
)
from gpipe_repro.report.wandb_log import RunLogger, read_metrics, resolve_mode

REPO = Path(__file__).resolve().parents[2]


class ExplodesWhenSerialized:
    """json.dump reaches this after having streamed part of the document."""

    def tolist(self) -> list[int]:
        raise RuntimeError("serialization failed midway")


def test_environment_describes_this_process() -> None:
    env = environment()
    assert env["torch"] == torch.__version__
    assert env["cores"] == len(os.sched_getaffinity(0))
    assert env["torch_threads"] == torch.get_num_threads()
    assert env["device"] and isinstance(env["device"], str)
    assert env["time_utc"].endswith("+00:00")
    assert len(env["git_commit"] or "0" * 40) == 40  # None outside a git checkout
    json.dumps(env)  # JSON-ready as is


def test_write_json_embeds_environment_and_round_trips(tmp_path: Path) -> None:
    path = write_json(tmp_path / "sub" / "r.json",
                      {"speedup": measured(torch.tensor(3.25), paper=3.5, unit="x"),
                       "sim": Result(1.5, "simulated"), "n": torch.arange(3)})
    data = read_json(path)
    assert data["speedup"] == {"value": 3.25, "method": "measured", "paper": 3.5, "unit": "x"}
    assert data["sim"] == {"value": 1.5, "method": "simulated"}
    assert data["n"] == [0, 1, 2]
    assert data["environment"]["torch"] == torch.__version__
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temp file left


def test_failed_serialization_leaves_previous_file_intact(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_json(path, {"version": 1})
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="midway"):
        write_json(path, {"version": 2, "rows": list(range(5000)), "bad": ExplodesWhenSerialized()})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    with pytest.raises(RuntimeError):
        write_json(tmp_path / "new.json", {"bad": ExplodesWhenSerialized()})
    assert not (tmp_path / "new.json").exists()


def test_process_killed_mid_write_never_leaves_a_complete_looking_file(tmp_path: Path) -> None:
    """The process dies (os._exit, no cleanup at all) while streaming the JSON: the destination
    keeps its old content and only a hidden temp file remains."""
    path = tmp_path / "r.json"
    write_json(path, {"version": 1})
    script = textwrap.dedent(f"""
        import os
        from gpipe_repro.report.records import write_json
        class Die:
            def tolist(self):
                os._exit(3)
        write_json({str(path)!r}, {{"version": 2, "rows": list(range(20000)), "x": Die()}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, timeout=120)
    assert proc.returncode == 3, proc.stderr.decode()
    assert read_json(path)["version"] == 1
    leftovers = [p for p in tmp_path.iterdir() if p.name != "r.json"]
    assert leftovers and all(p.name.startswith(".r.json.") for p in leftovers)
    assert b'"version": 2' in leftovers[0].read_bytes()  # it really died midway through the write


def test_atomic_write_binary_and_markdown(tmp_path: Path) -> None:
    with atomic_write(tmp_path / "b.bin", "wb") as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.bin").stat().st_mode & 0o777 == 0o666 & ~results._UMASK  # not mkstemp's 0600
    with pytest.raises(KeyError), atomic_write(tmp_path / "m.md") as f:
        f.write("half")
        raise KeyError("crash")
    assert not (tmp_path / "m.md").exists()
    write_markdown(tmp_path / "m.md", "# Title\n\n\n")
    assert (tmp_path / "m.md").read_text() == "# Title\n"


def test_records_and_formatting() -> None:
    with pytest.raises(ValueError, match="method"):
        Result(1.0, "guessed")  # type: ignore[arg-type]
    assert Result(3.0, "measured", paper=4.0).ratio_to_paper == 0.75
    assert Result(3.0, "measured").ratio_to_paper is None
    assert format_record(measured(3.4567, paper=3.5)) == "3.46 (paper 3.5)"
    assert format_record(simulated(2.0)) == "2*"
    assert format_record(measured(None, paper=1)) == "- (paper 1)"


def test_markdown_table_renders_numbers_records_and_escapes() -> None:
    table = markdown_table(["model", "K", "speedup"],
                           [["AmoebaNet|D", 2, measured(1.8123, paper=1.8)],
                            ["Transformer", 4, None],
                            ["big", 12345.678, simulated(0.5)]])
    lines = table.splitlines()
    assert len(lines) == 5

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split(" | ")]

    assert cells(lines[0]) == ["model", "K", "speedup"]
    assert [c.replace("-", "") for c in cells(lines[1])] == ["", ":", ":"]  # numbers right-aligned
    assert cells(lines[2]) == ["AmoebaNet\\|D", "2", "1.81 (paper 1.8)"]
    assert cells(lines[3]) == ["Transformer", "4", "-"]
    assert cells(lines[4]) == ["big", "12346", "0.5*"]
    assert len({len(line) for line in lines}) == 1  # columns padded to equal width
    with pytest.raises(ValueError, match="row 0"):
        markdown_table(["a", "b"], [[1]])


# ----------------------------------------------------------------------------- run logger

@pytest.fixture
def wandb_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in list(os.environ):
        if var.startswith("WANDB_"):
            monkeypatch.delenv(var)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("NETRC", raising=False)
    return tmp_path


def test_mode_defaults_to_offline_and_validates(wandb_sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_mode(None) == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode(None) == "disabled"
    assert resolve_mode("dryrun") == "offline"
    with pytest.raises(ValueError, match="WANDB_MODE"):
        resolve_mode("sometimes")


def test_disabled_logger_writes_local_files_without_importing_wandb(
        wandb_sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` would now raise
    run_dir = wandb_sandbox / "run"
    png = wandb_sandbox / "plot.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    with RunLogger("p", {"lr": 0.1}, mode="disabled", dir=run_dir) as logger:
        logger.log({"loss": torch.tensor(2.5), "lr": 0.1}, step=0)
        logger.log({"loss": 1.5}, step=1)
        logger.log_table("speedups", ["K", "speedup"], [[2, 1.8], [4, 3.2]])
        logger.log_image("gantt", png)
        logger.summary({"final_loss": 1.5})
        assert read_json(run_dir / "run.json")["status"] == "running"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(0, 2.5), (1, 1.5)]
    run = read_json(run_dir / "run.json")
    assert run["status"] == "finished" and run["wandb_id"] is None
    assert run["config"] == {"lr": 0.1} and run["summary"] == {"final_loss": 1.5}
    assert read_json(run_dir / run["tables"]["speedups"])["rows"] == [[2, 1.8], [4, 3.2]]
    assert (run_dir / run["images"]["gantt"]).read_bytes() == png.read_bytes()
    with pytest.raises(TypeError, match="log_table"):
        RunLogger("p", mode="disabled", dir=run_dir).log({"bad": [1, 2]})


def test_failed_run_is_marked_failed_and_resume_drops_later_rows(wandb_sandbox: Path) -> None:
    run_dir = wandb_sandbox / "run"
    with pytest.raises(RuntimeError, match="crash"), \
            RunLogger("p", mode="disabled", dir=run_dir) as logger:
        for step in range(5):
            logger.log({"loss": float(step)}, step=step)
        logger.summary({"best": 0.0})
        raise RuntimeError("crash after step 4")
    assert read_json(run_dir / "run.json")["status"] == "failed"
    resumed = RunLogger("p", mode="disabled", dir=run_dir, resume_step=3)  # checkpoint was at step 3
    resumed.log({"loss": 30.0}, step=3)
    resumed.finish()
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
    assert read_json(run_dir / "run.json")["summary"] == {"best": 0.0}


def test_online_without_api_key_fails_clearly(wandb_sandbox: Path) -> None:
    with pytest.raises(RuntimeError, match="WANDB_API_KEY"):
        RunLogger("p", mode="online", dir=wandb_sandbox / "run")


def test_offline_wandb_run_lands_locally(wandb_sandbox: Path) -> None:
    # How long it takes (target 30 s) is `make bench-latency`'s, not a test's.
    run_dir = wandb_sandbox / "run"
    logger = RunLogger("gpipe-repro-test", {"K": 2, "M": 4}, dir=run_dir)  # mode from default
    for step in range(3):
        logger.log({"loss": 1.0 / (step + 1)}, step=step)
    logger.log_table("t", ["a"], [[1]])
    logger.summary({"final": 0.25})
    logger.finish()
    run = read_json(run_dir / "run.json")
    assert run["mode"] == "offline" and run["status"] == "finished" and run["wandb_id"]
    wandb_run = Path(run["wandb_dir"])
    assert wandb_run.parent.parent == run_dir and wandb_run.name.startswith("offline-run-")
    assert list(wandb_run.glob("run-*.wandb")), "wandb wrote no offline run file"
    assert [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1.0, 0.5, 1.0 / 3]


# ----------------------------------------------------------------------------- measured-cell cleanliness

def _row(k: int, m: int, throughput: float, idle: float | None) -> dict:
    host = None if idle is None else {"idle_fraction_before": idle, "load_average_before": 3.0}
    return {"model": "transformer", "K": k, "M": m, "microbatch": 4, "batch": 4 * m, "balance": [1, 1],
            "balance_efficiency": 1.0,
            "simulated": {"throughput": throughput, "normalized": 1.0, "bubble_fraction": 0.1},
            "measured": {"throughput": throughput, "host": host}, "bubble_theory": 0.1}


def test_a_busy_measured_cell_is_marked_in_markdown_and_wandb_and_a_clean_one_is_not() -> None:
    from gpipe_repro.repro.throughput.outputs import _host_label
    from gpipe_repro.repro.throughput.report import _detail, _paper_layout, any_busy, measured_note
    from gpipe_repro.repro.throughput.rows import Row, normalize

    rows = [Row("transformer", 2, m, 4, 4 * m, [1, 1], 1.0, {"throughput": 10.0 * m, "bubble_fraction": 0.1},
                {"throughput": 10.0 * m, "host": {"idle_fraction_before": idle,
                                                  "load_average_before": 0.2}})
            for m, idle in ((1, 0.97), (4, 0.95), (32, 0.40))]
    normalize(rows, (2, 1))
    assert [r.measured["normalized_clean"] for r in rows if r.measured] == [True, True, False]
    payload = {"table2": {"transformer": [{**r.to_json()} for r in rows]}}
    md = _paper_layout(payload["table2"]["transformer"])
    assert "measured 4.00 " in md and "measured 4.00 †" not in md   # clean: a plain number
    assert "measured 32.00 †busy (idle 40%, load 0.2)" in md   # busy: visibly marked
    assert "†busy" in _detail(payload["table2"]["transformer"], "flop")
    assert any_busy(payload)
    assert _host_label(payload["table2"]["transformer"][1]["measured"]) == "clean"
    assert _host_label(payload["table2"]["transformer"][2]["measured"]).startswith("BUSY")
    # A ratio against a busy reference is not clean either; an unrecorded host state is marked.
    assert "reference" in measured_note({"normalized_clean": False, "host": {"idle_fraction_before": 1.0}},
                                        normalized=True)
    assert "not recorded" in measured_note({"throughput": 1.0})


def test_a_simulation_only_run_never_replaces_a_measured_table(tmp_path: Path) -> None:
    from gpipe_repro.repro.throughput.outputs import check_overwrite, write_outputs

    measured_table = {"table2": {"transformer": [_row(2, 1, 10.0, 0.95)]}, "table3": {}}
    write_json(tmp_path / "throughput_table.json", measured_table)
    before = (tmp_path / "throughput_table.json").read_bytes()
    with pytest.raises(FileExistsError, match="--out DIR"):
        check_overwrite(tmp_path, measuring=False)
    check_overwrite(tmp_path, measuring=True)                 # measured replaces measured
    check_overwrite(tmp_path / "elsewhere", measuring=False)  # nothing there to lose
    simulated_only = {"table2": {"transformer": [{**_row(2, 1, 10.0, None), "measured": None}]}}
    with pytest.raises(FileExistsError):
        write_outputs(simulated_only, tmp_path, log_wandb=False)
    assert (tmp_path / "throughput_table.json").read_bytes() == before


def test_the_page_says_which_command_made_it() -> None:
    from gpipe_repro.repro.throughput.report import generated_by

    assert generated_by({}) == "`make throughput-table`"
    assert generated_by({"command": {"prog": "p", "argv": []}}) == "`make throughput-table`"
    text = generated_by({"command": {"prog": "gpipe-repro throughput-table", "argv": ["--no-measure"]}})
    assert text == "`gpipe-repro throughput-table --no-measure` (not `make throughput-table`)"


def test_busy_measured_points_are_drawn_apart(tmp_path: Path) -> None:
    from gpipe_repro.report.plots import plot_speedups

    rows = [{**_row(2, m, 10.0 * m, None), "measured": {"normalized": float(m),
                                                         "normalized_clean": m != 4}}
            for m in (1, 4)]
    for r in rows:
        r["simulated"]["normalized"] = float(r["M"])
    assert plot_speedups({"transformer": rows}, tmp_path / "s.png").stat().st_size > 0


def test_a_cell_measured_by_the_kernel_shows_its_interval_not_a_busy_mark() -> None:
    from gpipe_repro.report.measurement import Figure
    from gpipe_repro.repro.throughput.outputs import _host_label
    from gpipe_repro.repro.throughput.report import _paper_layout, any_busy

    row = _row(2, 4, 40.0, None)
    row["measured"] = {"throughput": 40.0, "normalized": 4.0,
                       "step_figure": Figure("t", 0.025, 0.024, 0.026, 6, "m", unit="s").to_json(),
                       "normalized_figure": Figure("n", 4.0, 3.9, 4.1, 6, "m").to_json()}
    md = _paper_layout([row])
    assert "measured 4.00 [3.90, 4.10]" in md and "†" not in md
    assert not any_busy({"table2": {"transformer": [row]}})
    assert _host_label(row["measured"]) == "95% interval [3.90, 4.10]"


def test_the_page_states_the_calibrations_uncertainty_not_a_busy_host() -> None:
    from gpipe_repro.repro.throughput.report import calibration_uncertainty

    text = calibration_uncertainty({"transformer": {"uncertainty": {"4": 0.031}}, "amoebanet": {}})
    assert "transformer 3.1% at micro-batch 4" in text and "most even cut" in text
