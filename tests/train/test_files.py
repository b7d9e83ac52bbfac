"""What a run does to files: nothing a user owns is deleted or overwritten, checkpoints that
cannot be read are named and skipped, a full disk says so and leaves the previous checkpoint intact."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gpipe_repro.cli import app
from gpipe_repro.train import checkpoints
from gpipe_repro.train.checkpoints import (
    CheckpointError,
    DiskFullError,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
)
from gpipe_repro.train.run_dir import MANIFEST, RunDirectory, check_run_dir, fresh_run_dir, resolve_run_dir

USER_FILES = {"holiday.png": b"\x89PNG not really", "budget.csv": b"rent,900\n", "my_model.pt": b"weights"}


def user_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in USER_FILES.items():
        (path / name).write_bytes(data)
    return path


def assert_user_files_intact(path: Path) -> None:
    for name, data in USER_FILES.items():
        assert (path / name).read_bytes() == data, name


def fake_state(step: int) -> dict:
    """A training checkpoint's shape (what `training_state` returns), small."""
    return {"format": checkpoints.CHECKPOINT_FORMAT, "step": step, "state": {"w": torch.arange(4.0) + step},
            "generators": {}, "rng": {}, "extra": {"run": {}, "task": {}}}


# ----------------------------------------------------------------------------- run directories

def test_out_refuses_a_folder_of_user_files_and_changes_nothing(tmp_path: Path) -> None:
    folder = user_folder(tmp_path / "mine")
    result = CliRunner().invoke(app, ["run", "amoebanet", "--preset", "smoke", "--out", str(folder),
                                      "--wandb", "disabled", "--no-progress"])
    assert result.exit_code == 2
    assert "is not a previous training run" in result.output and "holiday.png" in result.output
    assert sorted(p.name for p in folder.iterdir()) == sorted(USER_FILES)
    assert_user_files_intact(folder)


def test_a_new_run_replaces_only_the_files_the_previous_run_created(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = RunDirectory(run, "amoebanet", resume=False)
    (run / "checkpoints").mkdir()
    torch.save({}, run / "checkpoints" / "step-00000004.pt")
    (run / "summary.json").write_text(json.dumps({"kind": "training-run", "task": "amoebanet",
                                                  "status": "finished"}))
    (run / "wandb" / "offline-run-1").mkdir(parents=True)
    (run / "wandb" / "offline-run-1" / "run.wandb").write_text("x")
    first.update()
    first.release()                                     # the run has ended
    user_folder(run)                                    # the user adds files after the run
    (run / "checkpoints" / "notes.txt").write_text("mine too")

    with pytest.raises(FileExistsError, match="holds a previous `amoebanet` run.*--overwrite"):
        RunDirectory(run, "amoebanet", resume=False)    # not without being asked
    assert (run / "summary.json").exists()
    RunDirectory(run, "amoebanet", resume=False, overwrite=True)   # a new run of the same task here
    assert_user_files_intact(run)
    assert (run / "checkpoints" / "notes.txt").read_text() == "mine too"
    assert not (run / "summary.json").exists() and not (run / "wandb").exists()
    assert not list_checkpoints(run / "checkpoints")
    with pytest.raises(FileExistsError, match="holds a `amoebanet` run"):
        check_run_dir(run, "transformer", resume=False)


def test_a_legacy_run_directory_without_manifest_keeps_foreign_files(tmp_path: Path) -> None:
    run = user_folder(tmp_path / "amoebanet-cpu")
    (run / "summary.json").write_text(json.dumps({"kind": "training-run", "task": "amoebanet",
                                                  "status": "finished"}))
    (run / "metrics.jsonl").write_text("{}\n")
    RunDirectory(run, "amoebanet", resume=False, overwrite=True)
    assert_user_files_intact(run)
    assert not (run / "metrics.jsonl").exists()
    assert json.loads((run / MANIFEST).read_text())["files"] == [MANIFEST]


def test_runs_go_to_a_fresh_directory_and_record_only_when_asked(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert fresh_run_dir("amoebanet-cpu") == Path("runs/amoebanet-cpu")
    assert Path("runs/amoebanet-cpu").is_dir()           # claimed when chosen
    fresh = resolve_run_dir("amoebanet-cpu", out=None, record=False, resume=False)
    assert fresh == Path("runs/amoebanet-cpu-2")
    Path("runs/amoebanet-cpu-7").mkdir()
    assert fresh_run_dir("amoebanet-cpu") == Path("runs/amoebanet-cpu-8")
    assert resolve_run_dir("amoebanet-cpu", out=None, record=True, resume=False) == \
        Path("results/training/amoebanet-cpu")
    with pytest.raises(FileNotFoundError, match="no run named 'amoebanet-cpu' with checkpoints"):
        resolve_run_dir("amoebanet-cpu", out=None, record=False, resume=True)
    save_checkpoint(checkpoint_path("runs/amoebanet-cpu-2/checkpoints", 3), fake_state(3))
    resumed = resolve_run_dir("amoebanet-cpu", out=None, record=False, resume=True)
    assert resumed == Path("runs/amoebanet-cpu-2")
    with pytest.raises(ValueError, match="give one of them"):
        resolve_run_dir("x", out="elsewhere", record=True, resume=False)
    # the results of record follow $GPIPE_REPRO_RESULTS, as every results writer does (--record
    # wrote to ./results/training with the variable set, where a user kept the checkout's safe)
    monkeypatch.setenv("GPIPE_REPRO_RESULTS", str(tmp_path / "elsewhere"))
    assert resolve_run_dir("amoebanet-cpu", out=None, record=True, resume=False) == \
        tmp_path / "elsewhere" / "training" / "amoebanet-cpu"


def test_resume_without_a_checkpoint_names_the_directory(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["run", "amoebanet", "--preset", "smoke", "--out",
                                      str(tmp_path / "typo"), "--resume", "--wandb", "disabled",
                                      "--no-progress"])
    assert result.exit_code == 2
    assert "no checkpoint in" in result.output and "typo" in result.output
    assert not (tmp_path / "typo").exists()


# ----------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("damage", ["truncated", "empty", "foreign", "garbage"])
def test_an_unreadable_latest_checkpoint_is_named_and_the_older_one_used(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "checkpoints"
    save_checkpoint(checkpoint_path(directory, 2), fake_state(2), keep_last=None)
    latest = save_checkpoint(checkpoint_path(directory, 4), fake_state(4), keep_last=None)
    data = latest.read_bytes()
    if damage == "truncated":
        latest.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        latest.write_bytes(b"")
    elif damage == "foreign":
        torch.save({"model": {"w": torch.zeros(2)}}, latest)    # someone's own weights file
    else:
        latest.write_bytes(b"not a checkpoint at all" * 10)

    if damage != "foreign":
        with pytest.raises(CheckpointError, match=str(latest).replace(".", r"\.")):
            load_checkpoint(latest)
    warnings: list[str] = []
    checkpoint, path = load_latest_checkpoint(directory, warn=warnings.append)
    assert path == checkpoint_path(directory, 2) and checkpoint["step"] == 2
    assert len(warnings) == 1 and str(latest) in warnings[0] and "step-00000002.pt" in warnings[0]


def test_resuming_removes_the_temporary_file_of_a_save_a_kill_cut_short(tmp_path: Path) -> None:
    """After `kill -9` during a save, checkpoints/.step-00000008.pt.<random>.tmp stayed through a
    successful --resume and was listed among the run's files."""
    directory = tmp_path / "checkpoints"
    save_checkpoint(checkpoint_path(directory, 4), fake_state(4), keep_last=None)
    leftover = directory / ".step-00000008.pt.nrh3um82.tmp"
    leftover.write_bytes(b"")
    mine = directory / ".notes.tmp"            # not the checkpoint writer's: stays
    mine.write_text("x")
    checkpoint, path = load_latest_checkpoint(directory)
    assert checkpoint["step"] == 4 and not leftover.exists() and mine.exists()


def test_no_readable_checkpoint_lists_every_file_and_what_to_do(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    checkpoint_path(directory, 1).write_bytes(b"")
    with pytest.raises(CheckpointError, match="can be read") as caught:
        load_latest_checkpoint(directory, warn=lambda m: None)
    assert "step-00000001.pt" in str(caught.value) and "start a new run" in str(caught.value)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        load_latest_checkpoint(tmp_path / "nothing")


@pytest.mark.parametrize("how", ["ENOSPC", "torch short write"])
def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(tmp_path: Path, how: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "checkpoints"
    previous = save_checkpoint(checkpoint_path(directory, 2), fake_state(2), keep_last=1)
    before = previous.read_bytes()
    real_save = torch.save

    def full_disk(obj: object, f: object, *args: object, **kwargs: object) -> None:
        f.write(b"PK\x03\x04 partial")   # type: ignore[attr-defined]
        if how == "ENOSPC":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 553664 vs 553552")

    monkeypatch.setattr(checkpoints.torch, "save", full_disk)
    if how != "ENOSPC":
        monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda p: type("U", (), {"free": 0})())
    with pytest.raises(DiskFullError, match="no space left") as caught:
        save_checkpoint(checkpoint_path(directory, 4), fake_state(4), keep_last=1)
    assert str(previous) in str(caught.value) and "intact" in str(caught.value)
    monkeypatch.setattr(checkpoints.torch, "save", real_save)
    assert list_checkpoints(directory) == [previous] and previous.read_bytes() == before
    assert sorted(p.name for p in directory.iterdir()) == [previous.name]    # no temporary left


def test_clearing_a_run_for_a_rerun_keeps_what_the_user_added(tmp_path: Path) -> None:
    from gpipe_repro.train.run_dir import clear_run
    run = tmp_path / "run"
    directory = RunDirectory(run, "transformer", resume=False)
    save_checkpoint(checkpoint_path(run / "checkpoints", 2), fake_state(2))     # unfinished
    directory.update()
    user_folder(run / "notes")
    deleted = clear_run(run)
    assert "checkpoints/step-00000002.pt" in deleted and not (run / "checkpoints").exists()
    assert_user_files_intact(run / "notes")
    assert clear_run(tmp_path / "absent") == []


def test_runs_started_together_never_share_a_directory(tmp_path: Path) -> None:
    """The fresh directory is claimed (created) when it is chosen: 8 threads choosing at once get 8
    different directories (two runs of a seed sweep got the same one, and the second deleted the
    first's files)."""
    import threading
    chosen: list[Path] = []
    start = threading.Barrier(8)

    def choose() -> None:
        start.wait()
        chosen.append(fresh_run_dir("sweep", tmp_path / "runs"))
    threads = [threading.Thread(target=choose) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(chosen)) == 8 and all(p.is_dir() for p in chosen)


def test_a_file_added_while_the_run_trains_is_not_the_runs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    directory = RunDirectory(run, "amoebanet", resume=False)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "NOTES.txt").write_text("mine, written during the run")
    directory.update()
    (run / "summary.json").write_text(json.dumps({"kind": "training-run", "task": "amoebanet",
                                                  "status": "finished"}))
    directory.update()
    directory.release()
    assert "NOTES.txt" not in json.loads((run / MANIFEST).read_text())["files"]
    RunDirectory(run, "amoebanet", resume=False, overwrite=True)
    assert (run / "NOTES.txt").read_text() == "mine, written during the run"
    assert not (run / "metrics.jsonl").exists()


def test_the_users_directory_itself_is_kept_and_names_are_plain(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty --out directory is used as it is (same inode, mode: it was deleted and made again),
    through a symlink too; a --name with a path in it is refused."""
    import os
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o2770)
    inode = shared.stat().st_ino
    RunDirectory(shared, "amoebanet", resume=False)
    assert shared.stat().st_ino == inode and shared.stat().st_mode & 0o7777 == 0o2770
    link = tmp_path / "link"
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(target, link)
    RunDirectory(link, "amoebanet", resume=False)
    assert link.is_symlink() and (target / MANIFEST).exists()
    for bad in ("../../escaped", "a/b", "..", ".hidden"):
        with pytest.raises(ValueError, match="not a plain folder name"):
            resolve_run_dir(bad, out=None, record=False, resume=False)


def test_a_run_killed_before_its_manifest_listed_its_files_is_cleaned_by_the_next(tmp_path: Path) -> None:
    """The manifest is rewritten at saves; a run that died before one still owns the files of its
    kinds (metrics.jsonl, run.json, a checkpoint cut short), and --overwrite removes them: the new
    run's metrics.jsonl must not start with the dead run's rows."""
    run = tmp_path / "run"
    RunDirectory(run, "amoebanet", resume=False)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "run.json").write_text(json.dumps({"config": {"task_name": "amoebanet"}}))
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / ".step-00000002.pt.k3j2.tmp").write_text("half")
    (run / "mine.txt").write_text("mine")
    RunDirectory(run, "amoebanet", resume=False, overwrite=True)
    assert not (run / "metrics.jsonl").exists() and not (run / "run.json").exists()
    assert not (run / "checkpoints").exists() and (run / "mine.txt").read_text() == "mine"


def test_under_torchrun_every_rank_names_the_same_fresh_directory(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    (tmp_path / "runs" / "x").mkdir(parents=True)
    assert fresh_run_dir("x", tmp_path / "runs") == fresh_run_dir("x", tmp_path / "runs") == \
        tmp_path / "runs" / "x-2"
    assert not (tmp_path / "runs" / "x-2").exists()


def test_overwrite_deleted_the_users_files_in_the_loggers_folders(tmp_path: Path) -> None:
    """Every file under images/, tables/ and wandb/ counted as the run's, so --overwrite deleted a
    figure, a table or notes the user had put there (and a file added there while the run trained
    was listed in its manifest). The run's files there are now those its run.json lists and W&B's
    own (its logs, its run folders)."""
    run = tmp_path / "run"
    directory = RunDirectory(run, "amoebanet", resume=False)
    (run / "images").mkdir()
    (run / "images" / "curves.png").write_bytes(b"png")
    (run / "tables").mkdir()
    (run / "tables" / "eval.json").write_text("{}")
    (run / "run.json").write_text(json.dumps({"config": {"task_name": "amoebanet"},
                                              "images": {"curves": "images/curves.png"},
                                              "tables": {"eval": "tables/eval.json"}}))
    (run / "wandb" / "offline-run-20261127_063144-jjw3mw4x" / "files").mkdir(parents=True)
    (run / "wandb" / "offline-run-20261127_063144-jjw3mw4x" / "files" / "req.txt").write_text("x")
    (run / "wandb" / "debug.log").write_text("log")
    (run / "images" / "during.png").write_bytes(b"mine, added while it trained")
    directory.update()
    listed = json.loads((run / MANIFEST).read_text())["files"]
    assert "images/curves.png" in listed and "images/during.png" not in listed
    (run / "summary.json").write_text(json.dumps({"kind": "training-run", "task": "amoebanet",
                                                  "status": "finished"}))
    directory.update()
    directory.release()
    mine = {"images/my_figure.png": b"fig", "tables/my_results.csv": b"a,b\n",
            "wandb/mine/notes.txt": b"notes"}
    for rel, data in mine.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(data)
    RunDirectory(run, "amoebanet", resume=False, overwrite=True)
    for rel, data in mine.items():
        assert (run / rel).read_bytes() == data, rel
    assert (run / "images" / "during.png").exists()
    assert not (run / "images" / "curves.png").exists() and not (run / "tables" / "eval.json").exists()
    assert not (run / "wandb" / "debug.log").exists()
    assert not (run / "wandb" / "offline-run-20261127_063144-jjw3mw4x").exists()


def test_two_processes_resumed_one_run_at_once_and_interleaved_their_metrics(tmp_path: Path) -> None:
    """A fresh directory was claimed atomically, but two --resume of one run (or two runs given
    one --out) both trained into it: metrics.jsonl held every step twice. The directory is now
    locked while a run writes it; the second is refused before changing anything, and the
    directory is free again once the first has ended."""
    import subprocess
    import sys

    run = tmp_path / "run"
    first = RunDirectory(run, "amoebanet", resume=False)
    (run / "checkpoints").mkdir()
    torch.save({}, run / "checkpoints" / "step-00000002.pt")
    first.update()
    code = ("import sys; from pathlib import Path; from gpipe_repro.train.run_dir import RunDirectory\n"
            "try:\n    RunDirectory(Path(sys.argv[1]), 'amoebanet', resume=True)\n"
            "except FileExistsError as e:\n    print(e); sys.exit(3)\n")
    other = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True)
    assert other.returncode == 3 and "another process is writing" in other.stdout, other
    with pytest.raises(FileExistsError, match="another process is writing"):
        RunDirectory(run, "amoebanet", resume=True)        # a second claim in this process too
    first.release()
    again = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True)
    assert again.returncode == 0, again


def test_out_under_a_file_says_which_path_is_a_file(tmp_path: Path) -> None:
    """`run --out FILE/sub` printed "[Errno 20] Not a directory"; it names the file in the way."""
    from gpipe_repro.train.run_dir import resolve_run_dir

    (tmp_path / "afile").write_text("mine\n")
    for out in (tmp_path / "afile" / "sub", tmp_path / "afile"):
        with pytest.raises(ValueError, match=f"{tmp_path / 'afile'} is a file, not a directory"):
            resolve_run_dir("r", out=str(out), record=False, resume=False)
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_resume_started_while_the_run_trained_removed_its_half_written_checkpoint(tmp_path: Path) -> None:
    """`run --resume` read the checkpoints, and removed the temporary file of a save cut short,
    before it claimed the directory: started while the run still trained, it removed that run's
    checkpoint as it was being written, the run failed on it ("No such file or directory:
    .step-00000016.pt...tmp"), and the resume then found the directory free and trained on. The
    directory is now claimed first: the resume is refused and the save under way is left alone."""
    run = tmp_path / "run"
    training = RunDirectory(run, "amoebanet", resume=False)
    save_checkpoint(checkpoint_path(run / "checkpoints", 8), fake_state(8), keep_last=None)
    writing = run / "checkpoints" / ".step-00000016.pt.nqg0cty5.tmp"
    writing.write_bytes(b"half a checkpoint")
    training.update()
    result = CliRunner().invoke(app, ["run", "amoebanet", "--preset", "smoke", "--resume", "--out", str(run),
                                      "--wandb", "disabled"])
    assert result.exit_code != 0 and "another process is writing" in " ".join(result.output.split())
    assert writing.read_bytes() == b"half a checkpoint"
    training.release()


def test_silent_a_checkpoint_with_a_flipped_bit_was_resumed_from(tmp_path: Path) -> None:
    """One byte of a weight in the newest checkpoint changed on disk: --resume loaded it as a value
    (torch.load does not check the archive's CRCs) and trained on from a different model. The
    damaged file is now named, and the one before it is resumed from."""
    directory = tmp_path / "checkpoints"
    save_checkpoint(checkpoint_path(directory, 2), fake_state(2), keep_last=None)
    latest = save_checkpoint(checkpoint_path(directory, 4), fake_state(4), keep_last=None)
    data = bytearray(latest.read_bytes())
    at = bytes(data).find((torch.arange(4.0) + 4).numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x01
    latest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is damaged: its record .* fails its CRC check"):
        load_checkpoint(latest)
    warnings: list[str] = []
    checkpoint, path = load_latest_checkpoint(directory, warn=warnings.append)
    assert checkpoint["step"] == 2 and len(warnings) == 1 and "damaged" in warnings[0]


def test_a_transfer_without_a_pretraining_run_left_an_empty_runs_transfer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpipe-repro run transfer` in a fresh directory fails (no pretraining checkpoint at its
    default --from) and left an empty runs/transfer, so the next one wrote runs/transfer-2. It now
    leaves nothing, and its message says how to get a pretraining run."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "transfer", "--from", str(tmp_path / "nothing"),
                                      "--wandb", "disabled"])
    assert result.exit_code == 2 and "make train-amoebanet" in " ".join(result.output.split())
    assert not (tmp_path / "runs" / "transfer").exists()


def test_transfer_from_another_tasks_run_is_refused_naming_it(tmp_path: Path) -> None:
    """`run transfer --from <a Transformer run>` ended in a traceback (KeyError: 'input_shape') and
    left an empty runs/transfer/; --seeds 0 in "fmean requires at least one data point". Both are
    one line, exit 2, before any work, and no directory is left."""
    from gpipe_repro.train.tasks.transfer import pretraining_config
    state = fake_state(2)
    state["extra"]["task"] = {"L": 2, "A": 4, "corpus": "gettext"}
    save_checkpoint(checkpoint_path(tmp_path / "trun" / "checkpoints", 2), state)
    with pytest.raises(ValueError, match="is not an AmoebaNet run's checkpoint.*run amoebanet"):
        pretraining_config(tmp_path / "trun")
    runner = CliRunner()
    for args, says in (([], "is not an AmoebaNet run's checkpoint"),
                       (["--seeds", "0"], "--seeds must be >= 1")):
        result = runner.invoke(app, ["run", "transfer", "--from", str(tmp_path / "trun"),
                                     "--wandb", "disabled", "--out", str(tmp_path / "t"), *args])
        assert result.exit_code == 2 and says in result.output, result.output
        assert not (tmp_path / "t").exists()


def test_an_amoebanet_the_host_cannot_hold_is_refused_before_any_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run amoebanet --F 100000` (a 64,000 GiB peak) started building the model: only `run
    causal-lm` planned its peak. The image task now gives the run its memory planner; a peak above
    the host's available memory is refused before the model is built, naming the options that lower
    it, and no run directory is left."""
    from gpipe_repro.train import memory_check

    out = tmp_path / "run"
    args = ["run", "amoebanet", "--preset", "smoke", "--out", str(out), "--wandb", "disabled",
            "--no-progress"]
    refused = CliRunner().invoke(app, [*args, "--F", "100000"])
    said = " ".join(refused.output.split())
    assert refused.exit_code == 2, (refused.output, refused.exception)
    assert "of host memory at its peak" in said and "lower --F, --image-size or --batch-size" in said
    assert not out.exists()
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: 2 ** 10)   # 1 KiB left
    assert CliRunner().invoke(app, args).exit_code == 2 and not out.exists()
