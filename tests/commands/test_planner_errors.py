"""fit / plan / plan-replicas / pipeline: a user's mistake is a one-line usage error (exit code 2,
exit code 1 being "does not fit"), given before any work; --out / --timeline / --gantt never replace a
file the command did not write, and replace its own only with --overwrite."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpipe_repro.cli import app
from gpipe_repro.commands import memory as memory_command

TINY = ["transformer-lm", "--L", "2", "--d-model", "32", "--d-ff", "64", "--num-heads", "2",
        "--vocab-size", "100", "--seq-len", "8", "--batch-size", "8"]


@pytest.fixture
def no_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the model is the work: these errors must come before it."""
    def refuse(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the planner was built before the options were checked")
    monkeypatch.setattr(memory_command, "_planner", refuse)


def _usage_error(args: list[str], *, says: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit)       # no traceback
    assert says in " ".join(result.output.replace("│", " ").split()), result.output


@pytest.mark.parametrize("args, says", [
    (["fit", "transformer-lm", "--k", "2", "--balance", "a,b"], "--balance takes integers"),
    (["fit", "transformer-lm", "--memory", "nan"], "--memory must be a number > 0"),
    (["fit", "transformer-lm", "--memory", "inf"], "--memory must be a number > 0"),
    (["plan", "transformer-lm", "--tflops", "0"], "--tflops must be a number > 0"),
    (["plan", "transformer-lm", "--link", "x"], "--link must be one of"),
    (["plan", "transformer-lm", "--memory", "nan"], "--memory must be a number > 0"),
    (["fit", "transformer-lm", "--schedule", "1fb1"], "schedule must be one of"),
    (["fit", "transformer-lm", "--k", "4", "--schedule", "interleaved", "--m", "3"], "multiple"),
    (["fit", "transformer-lm", "--k", "2", "--schedule", "1f1b", "--split-backwards", "1"],
     "is for the zero-bubble schedules"),
    (["fit", "transformer-lm", "--k", "2", "--m", "4", "--schedule", "zb-h1", "--split-backwards", "5"],
     "--split-backwards must be an integer from 0 to M = 4"),
    (["plan", "transformer-lm", "--attention", "x"], "--attention must be one of fused, math, got 'x'"),
    (["fit", "transformer-lm", "--optimizer", "lion"],
     "--optimizer must be one of sgd, momentum, rmsprop, adam, adamw, got 'lion'"),
])
def test_planner_mistakes_are_usage_errors_before_any_work(no_planning: None, args: list[str],
                                                           says: str) -> None:
    _usage_error(args, says=says)


@pytest.mark.parametrize("args, says", [
    (["plan-replicas", "transformer-lm", "--algorithm", "x"], "--algorithm must be one of ring, tree"),
    (["plan-replicas", "transformer-lm", "--optimizer", "lion"], "--optimizer must be one of sgd, momentum"),
    (["plan-replicas", "transformer-lm", "--tflops", "0"], "--tflops must be a number > 0"),
    (["plan-replicas", "transformer-lm", "--link", "x"], "--link must be one of"),
    (["plan-replicas", "transformer-lm", "--m", "4,x"], "--m takes integers"),
    (["plan-replicas", "transformer-lm", "--devices", "8", "--devices-per-host", "3"],
     "--devices 8 at --devices-per-host 3 is not a whole number of hosts"),
    (["plan-replicas", "transformer-lm", "--L", "0"], "--L takes an integer >= 1 for transformer-lm"),
    (["fit", "transformer-lm", "--L", "0"], "--L takes an integer >= 1 for transformer-lm"),
    (["fit", "transformer-lm", "--seq-len", "0"], "--seq-len takes an integer >= 1"),
    (["models", "transformer-lm", "--L", "two"],
     "--L takes an integer >= 1 for transformer-lm (default 48), got 'two'"),
    (["plan", "transformer-lm", "--k", "2"], "`gpipe-repro plan` passes the options it does not take "
                                             "itself to the model, and transformer-lm has no option k"),
    (["fit", "mymodels:make"], "A model of your own (module:function) is simulated by `gpipe-repro "
                               "throughput --model mymodels:make`"),
    (["plan", "mymodels:make"], "MemoryPlanner(layers, sample, target, loss_fn).plan(K, M)"),
])
def test_plan_replicas_and_model_size_mistakes_are_usage_errors(args: list[str], says: str) -> None:
    _usage_error(args, says=says)


def test_fit_out_is_checked_before_any_work(no_planning: None, tmp_path: Path) -> None:
    _usage_error(["fit", "transformer-lm", "--out", str(tmp_path)], says="is a directory")
    (tmp_path / "f").write_text("x")
    _usage_error(["fit", "transformer-lm", "--out", str(tmp_path / "f" / "p.json")],
                 says="is a file, not a directory")
    mine = tmp_path / "plan.json"
    mine.write_text("my precious\n")
    for extra in ([], ["--overwrite"]):
        _usage_error(["fit", "transformer-lm", "--out", str(mine), *extra],
                     says="is not a previous `gpipe-repro fit` output")
        _usage_error(["plan", "transformer-lm", "--out", str(mine), *extra],
                     says="is not a previous `gpipe-repro plan` output")
    assert mine.read_text() == "my precious\n"


def test_fit_out_creates_parents_and_replaces_its_own_only_with_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "no" / "such" / "fit.json"
    first = CliRunner().invoke(app, ["fit", *TINY, "--out", str(out)])
    assert first.exit_code in (0, 1), first.output
    assert json.loads(out.read_text())["written_by"] == "fit"
    _usage_error(["fit", *TINY, "--out", str(out)], says="pass --overwrite")
    again = CliRunner().invoke(app, ["fit", *TINY, "--out", str(out), "--overwrite"])
    assert again.exit_code in (0, 1), again.output
    # an output written before the stamp existed counts as the command's own
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps({"model": "m", "budget_gib": 1, "fits": True, "plan": {},
                                  "advice": [], "method": "simulated"}))
    assert CliRunner().invoke(app, ["fit", *TINY, "--out", str(legacy), "--overwrite"]).exit_code in (0, 1)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_repro.distributed import launcher

    def refuse(*args: Any, **kw: Any) -> Any:
        raise AssertionError("stage processes started before the output paths were checked")
    monkeypatch.setattr(launcher, "launch_local", refuse)


def test_pipeline_never_replaces_a_users_timeline_or_gantt(no_launch: None, tmp_path: Path) -> None:
    mine = tmp_path / "tl.json"
    mine.write_text("mine\n")
    for extra in ([], ["--overwrite"]):
        _usage_error(["pipeline", "--timeline", str(mine), *extra],
                     says="is not a previous `gpipe-repro pipeline` output")
        _usage_error(["pipeline", "--gantt", str(mine), *extra],
                     says="is not a previous `gpipe-repro pipeline` output")
    assert mine.read_text() == "mine\n"


def test_pipeline_replaces_its_own_files_only_with_overwrite(no_launch: None, tmp_path: Path) -> None:
    from gpipe_repro.report.records import write_json

    timeline = write_json(tmp_path / "d" / "timeline.json",
                          {"method": "measured", "options": {}, "timeline": {}, "written_by": "pipeline"})
    (tmp_path / "d" / "gantt.png").write_bytes(b"an earlier chart")   # its own: beside its timeline
    _usage_error(["pipeline", "--out", str(tmp_path / "d")], says="pass --overwrite")
    _usage_error(["pipeline", "--timeline", str(timeline)], says="pass --overwrite")
    # with --overwrite the checks pass and the (refused) launch is reached
    result = CliRunner().invoke(app, ["pipeline", "--out", str(tmp_path / "d"), "--overwrite"])
    assert isinstance(result.exception, AssertionError) and "stage processes" in str(result.exception)


def test_silent_plan_with_m_larger_than_the_batch_said_nothing_fits() -> None:
    """`plan -m 64 --batch-size 32` answered "nothing fits in 1e+05 GiB (no cut meets the memory
    cap)", exit 1: every candidate was M > batch. It is a usage error that says so."""
    _usage_error(["plan", *TINY[:-1], "32", "-m", "64", "--memory", "100000"],
                 says="--m candidates must be at most the batch size 32, got 64")


def test_plan_searches_only_the_micro_batches_a_schedule_can_run(tmp_path: Path) -> None:
    """dualpipe-v needs M >= 2K: the search asked it for M=1 and crashed with a traceback. Each
    schedule's own rules now decide which (K, M) it is a candidate for."""
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", *TINY, "--devices", "4", "--schedules",
                                      "dualpipe-v,interleaved", "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    rows = json.loads(out.read_text())["candidates"]
    assert rows and all(r["micro_batches"] >= 2 * r["partitions"] for r in rows
                        if r["schedule"] == "dualpipe-v")
    assert all(r["micro_batches"] % r["partitions"] == 0 for r in rows if r["schedule"] == "interleaved")


@pytest.mark.parametrize("args, says", [
    (["pipeline", "--checkpoint", "foo"], "--checkpoint must be one of always, except_last, never"),
    (["pipeline", "--timeout", "0"], "--timeout must be a number > 0 seconds"),
    (["pipeline", "--threads", "0"], "--threads must be >= 1"),
])
def test_pipeline_options_are_checked_before_any_process_starts(no_launch: None, args: list[str],
                                                                says: str) -> None:
    """--checkpoint foo started the stage processes and failed in them with two tracebacks;
    --timeout 0 printed c10d's C++ stack; --threads 0 was accepted."""
    _usage_error(args, says=says)



@pytest.mark.parametrize("args, says", [
    (["--fail-rank", "1"], "--fail-rank and --fail-call say where --fail-mode injects its failure"),
    (["--fail-call", "3"], "add --fail-mode (raise | kill | exit | hang)"),
    (["--fail-mode", "raise", "--fail-call", "0"], "--fail-call must be >= 1"),
    (["--launcher", "torchrun"], "start the job with torchrun, e.g. `torchrun --nproc-per-node 2 -- "
                                 "$(which gpipe-repro) pipeline --launcher torchrun --k 2`"),
])
def test_pipeline_fault_options_without_effect_and_torchrun_without_torchrun_are_usage_errors(
        no_launch: None, monkeypatch: pytest.MonkeyPatch, args: list[str], says: str) -> None:
    """--fail-rank / --fail-call without --fail-mode, and --fail-call 0, trained as if not given;
    --launcher torchrun outside torchrun ended in a traceback advising a script's launch."""
    monkeypatch.delenv("RANK", raising=False)
    _usage_error(["pipeline", *args], says=says)


def test_fit_plans_the_optimizer_the_training_runs(tmp_path: Path) -> None:
    """fit and plan assumed RMSProp's state (one 4-byte state a parameter) whatever the training ran:
    an AdamW training that did not fit was said to fit (an independent check measured 27.2 MB against
    a 25.3 MB budget fit had passed). --optimizer names it; the plan holds its state."""
    state = {}
    for name in ("sgd", "rmsprop", "adamw"):
        out = tmp_path / f"{name}.json"
        result = CliRunner().invoke(app, ["fit", *TINY, "--k", "1", "--m", "2", "--optimizer", name,
                                          "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert {"sgd": "SGD's (weight + gradient + no state", "rmsprop": "RMSProp's (weight + gradient + 1",
                "adamw": "AdamW's (weight + gradient + 2 states"}[name] in " ".join(result.output.split())
        written = json.loads(out.read_text())
        assert written["optimizer"] == name
        stage = written["plan"]["stages"][0]
        state[name] = stage["parts_bytes"].get("optimizer", 0)
    # one 4-byte state a parameter against two (and Adam's step counts)
    assert state["sgd"] == 0 and state["rmsprop"] > 0
    assert state["adamw"] == pytest.approx(2 * state["rmsprop"], rel=0.01)


def test_plan_leaves_out_the_micro_batches_batchnorm_cannot_train_on() -> None:
    """plan amoebanet-d failed with its default M candidates (powers of two up to the batch): at one
    example per micro-batch the auxiliary head's BatchNorm (after global pooling) has one value per
    channel, and the message blamed fake tensors and mixture-of-experts layers; plan-replicas printed
    a traceback. Such a default M is now left out, said why; an M the user gave is refused naming it."""
    small = ["amoebanet-d", "--L", "3", "--F", "8", "--image-size", "32", "--batch-size", "4"]
    result = CliRunner().invoke(app, ["plan", *small, "--devices", "2", "--memory", "16",
                                      "--schedules", "gpipe"])
    assert result.exit_code == 0, result.output
    assert "not planned: M=4 (micro-batches of 1 example)" in " ".join(result.output.split())
    assert "BatchNorm needs more than one value per channel" in " ".join(result.output.split())
    _usage_error(["plan", *small, "--m", "2,4", "--devices", "2"],
                 says="M=4 (micro-batches of 1 example)")
    result = CliRunner().invoke(app, ["plan-replicas", *small, "--devices", "2", "--memory", "16"])
    assert result.exit_code == 0 and "not planned: M=4" in result.output, result.output
