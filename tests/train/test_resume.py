"""A killed or interrupted run, resumed, ends exactly where an uninterrupted run ends.

Three ways to stop a run: an exception after step k (a crash), SIGINT (Ctrl-C: the loop saves and
exits cleanly) and SIGKILL of a `gpipe-repro run` subprocess (no chance to save anything; only the
periodic checkpoints survive). In each case the resumed run's every parameter, buffer and optimizer
slot must equal the uninterrupted run's, bit for bit (CPU, same seed), with dropout, drop-path and
augmentation all on.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe_repro.report.wandb_log import read_metrics
from gpipe_repro.train.checkpoints import checkpoint_path, list_checkpoints, load_checkpoint
from gpipe_repro.train.config import RunConfig
from gpipe_repro.train.loop import train
from gpipe_repro.train.tasks.image_classification import AmoebaNetConfig, AmoebaNetTask, preset
from tests.curves import curves_not_drawn

STEPS = 8


class Crash(Exception):
    pass


def configs(out: Path, **run_changes: Any) -> tuple[RunConfig, AmoebaNetConfig]:
    """The smoke preset made smaller: AmoebaNet-B (3, 8) on 8x8 digits, K=2, M=2, batch 8."""
    run, task = preset("smoke")
    run = dataclasses.replace(run, out_dir=str(out), batch_size=8, micro_batches=2, steps=STEPS,
                              eval_every=3, save_every=2, timeline_every=3, wandb="disabled",
                              progress=False, **run_changes)
    return run, task


def final_state(run_dir: Path) -> dict[str, Any]:
    checkpoint = load_checkpoint(checkpoint_path(run_dir / "checkpoints", STEPS))
    assert checkpoint["step"] == STEPS
    return checkpoint["state"]


def assert_same_training_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    model_a, model_b = a["pipeline"]["model"], b["pipeline"]["model"]
    assert model_a.keys() == model_b.keys()
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key
    for opt_a, opt_b in zip(a["pipeline"]["optimizers"], b["pipeline"]["optimizers"]):
        assert opt_a["state"].keys() == opt_b["state"].keys() and opt_a["state"]
        for slot in opt_a["state"]:
            for name, value in opt_a["state"][slot].items():
                assert torch.equal(value, opt_b["state"][slot][name]), (slot, name)
    assert a["data"] == b["data"]
    assert torch.equal(a["augmentation"]["generator"], b["augmentation"]["generator"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("reference")
    run, task = configs(out)
    with curves_not_drawn():           # its picture is never looked at (tests/curves.py)
        summary = train(AmoebaNetTask(task), run)
    assert summary.status == "finished" and summary.steps == STEPS
    return out, summary.losses


def test_resume_after_a_crash_gives_identical_weights(tmp_path: Path,
                                                      reference: tuple[Path, list[float]]) -> None:
    run, task = configs(tmp_path)

    def crash_after_step_4(step: int, loss: float) -> None:
        if step == 4:
            raise Crash

    with pytest.raises(Crash):
        train(AmoebaNetTask(task), run, on_step_end=crash_after_step_4)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")][-1] == "step-00000004.pt"
    with pytest.raises(FileExistsError, match="--resume"):     # an unfinished run is not overwritten
        train(AmoebaNetTask(task), run)
    resumed = train(AmoebaNetTask(task), dataclasses.replace(run, resume=True))
    assert resumed.status == "finished" and resumed.resumed_from == 4 and resumed.steps == STEPS
    assert resumed.losses == reference[1][4:]                  # step 4 ran again, identically
    assert_same_training_state(final_state(tmp_path), final_state(reference[0]))
    # the metrics log holds each step once, as if the run had never stopped
    logged = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert logged == list(range(1, STEPS + 1))                  # numbered by steps completed


@pytest.mark.usefixtures("undrawn_curves")     # curves.png not drawn (tests/curves.py)
def test_ctrl_c_saves_and_exits_cleanly_then_resumes_identically(
        tmp_path: Path, reference: tuple[Path, list[float]]) -> None:
    run, task = configs(tmp_path)

    def ctrl_c_during_step_2(step: int, loss: float) -> None:
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    summary = train(AmoebaNetTask(task), run, on_step_end=ctrl_c_during_step_2)
    assert summary.status == "interrupted" and summary.steps == 3
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")][-1] == "step-00000003.pt"
    resumed = train(AmoebaNetTask(task), dataclasses.replace(run, resume=True))
    assert resumed.resumed_from == 3 and resumed.status == "finished"
    assert_same_training_state(final_state(tmp_path), final_state(reference[0]))


@pytest.mark.usefixtures("undrawn_curves")     # curves.png not drawn (tests/curves.py)
def test_sigkilled_subprocess_resumes_identically(tmp_path: Path,
                                                  reference: tuple[Path, list[float]]) -> None:
    run, task = configs(tmp_path)
    command = [sys.executable, "-c", "from gpipe_repro.cli import main; main()", "run", "amoebanet",
               "--preset", "smoke",
               "--out", str(tmp_path), "--batch-size", "8", "--m", "2", "--steps", str(STEPS),
               "--eval-every", "3", "--save-every", "2", "--timeline-every", "3", "--wandb", "disabled",
               "--small-micro-batches",
               "--no-progress"]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    # The child writes to a file, not a pipe: an undrained pipe blocks a child that prints 64 KiB.
    # It is killed as soon as its first checkpoint is on disk, however long a busy host takes to get
    # there; the bound below only stops a child that hangs, and then the test fails with its output.
    log = tmp_path.with_name(tmp_path.name + "-child.log")    # beside the run directory, not in it
    first = checkpoint_path(tmp_path / "checkpoints", 2)
    with log.open("wb") as sink:
        child = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            hang_bound = time.monotonic() + 900
            while not first.exists() and child.poll() is None:
                assert time.monotonic() < hang_bound, "no checkpoint in 900 s:\n" + log.read_text()[-3000:]
                time.sleep(0.01)
            child.send_signal(signal.SIGKILL)
            child.wait()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    output = log.read_text()
    assert child.returncode == -signal.SIGKILL, \
        f"the child ended before its first checkpoint:\n{output[-3000:]}"
    saved = [int(p.stem.split("-")[1]) for p in list_checkpoints(tmp_path / "checkpoints")]
    assert saved and max(saved) < STEPS, f"killed after checkpoint 2, yet saved {saved}:\n{output[-3000:]}"
    resumed = train(AmoebaNetTask(task), dataclasses.replace(run, resume=True))
    assert resumed.resumed_from == max(saved)
    assert_same_training_state(final_state(tmp_path), final_state(reference[0]))


@pytest.mark.usefixtures("undrawn_curves")     # curves.png not drawn (tests/curves.py)
def test_resuming_a_finished_run_evaluated_and_logged_it_again(tmp_path: Path) -> None:
    """--resume of a run already at its last step trained nothing, yet evaluated it again and
    appended a second evaluation row for that step to metrics.jsonl. Its last evaluation and
    checkpoint now stand."""
    import json

    run, task = configs(tmp_path)
    train(AmoebaNetTask(task), run)
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    resumed = train(AmoebaNetTask(task), dataclasses.replace(run, resume=True))
    assert resumed.status == "finished" and resumed.steps == STEPS
    after = (tmp_path / "metrics.jsonl").read_text().splitlines()
    evals = [json.loads(r)["step"] for r in after if any(k.startswith("eval/") for k in json.loads(r))]
    assert len(evals) == len(set(evals)), evals
    assert len(after) == len(rows)


@pytest.mark.usefixtures("undrawn_curves")     # curves.png not drawn (tests/curves.py)
def test_an_auto_split_run_resumes_with_the_count_it_chose(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """--split-backwards auto chooses once, from timings; a resumed run splits as the run did (the
    count is saved with the cut), rather than choosing again from timings that may differ."""
    import gpipe_repro.engine.gpipe as gpipe_module
    chosen: list[tuple[list[int], int]] = []
    real = gpipe_module.cut_and_split

    def spy(*args: Any, **kwargs: Any) -> tuple[list[int], int]:
        chosen.append(real(*args, **kwargs))
        return chosen[-1]
    monkeypatch.setattr(gpipe_module, "cut_and_split", spy)
    run, task = configs(tmp_path, schedule="zb-h1", split_backwards="auto", partition_cost="time")

    def crash_after_step_4(step: int, loss: float) -> None:
        if step == 4:
            raise Crash
    with pytest.raises(Crash):
        train(AmoebaNetTask(task), run, on_step_end=crash_after_step_4)
    assert len(chosen) == 1
    resumed = train(AmoebaNetTask(task), dataclasses.replace(run, resume=True))
    assert resumed.status == "finished" and len(chosen) == 1          # not chosen again
    state = final_state(tmp_path)["pipeline"]
    assert (list(state["balance"]), state["split_backwards"]) == (chosen[0][0], chosen[0][1])
