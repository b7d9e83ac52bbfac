"""Checkpoints that a long training run can die and resume from, bit for bit.

What a resumable run must save (and what `training_state` gathers): the weights and the optimizer
(a `GPipe` holds both, one optimizer per cell), the learning-rate scheduler, every random stream
(Python, numpy, torch CPU and CUDA default generators, plus explicit generators such as the
augmentation's), and the data position (the batch iterator's `state_dict`). Anything with
`state_dict()` / `load_state_dict()` goes in `stateful`, so the run loop treats them all alike.

Why atomic, and why keep the last N. A checkpoint written while the process is killed must never be
picked up as the latest one: `save_checkpoint` writes to a temporary file, fsyncs it and renames it
(`gpipe_repro.report.records.atomic_write`). Keeping a few older ones guards against a checkpoint that is
complete but bad (a NaN that crept in just before it).

Checkpoints of a run live in one directory as `step-00001000.pt`; `latest_checkpoint` picks the
highest step. The directory is one linear history: to branch from an older step, use a new directory.

Why RNG states are stored as tensors and lists: `torch.load(weights_only=True)` (the safe default of
torch >= 2.6) accepts tensors, dicts, lists, tuples and numbers, but not numpy arrays; storing the
numpy state as plain ints keeps the safe loader usable.

Ctrl-C: `graceful_interrupt()` turns the first SIGINT/SIGTERM into a flag the loop polls between
steps, so it can save and exit cleanly; a second one aborts at once.
"""
from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shutil
import signal
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from gpipe_repro.report.records import atomic_write
from gpipe_repro.train.config import RESUME_MUST_MATCH, RunConfig

if TYPE_CHECKING:
    from gpipe_repro.train.task import Task

CHECKPOINT_FORMAT = 1
_NAME = re.compile(r"^step-(\d+)\.pt$")


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


# ----------------------------------------------------------------------------- files

def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """`<directory>/step-<step, 8 digits>.pt`: the name `latest_checkpoint` and pruning look for."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return Path(directory) / f"step-{step:08d}.pt"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The run's checkpoints, oldest (lowest step) first; temporary files are ignored."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint with the highest step in `directory`, or None."""
    checkpoints = list_checkpoints(directory)
    return checkpoints[-1] if checkpoints else None


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and what to do."""


class DiskFullError(OSError):
    """A checkpoint could not be written for lack of space; the previous checkpoints are intact."""


def _disk_full(error: BaseException, directory: Path) -> bool:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch's zip writer reports a short write as "unexpected pos N vs M", not as ENOSPC
    if isinstance(error, RuntimeError) and "unexpected pos" in str(error):
        try:
            return shutil.disk_usage(directory).free < 64 * 2**20
        except OSError:
            return True
    return False


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any], *,
                    keep_last: int | None = 3) -> Path:
    """Write `state` with `torch.save`, atomically; then delete all but the `keep_last` newest
    `step-*.pt` files in the same directory (None keeps everything). Returns the path.

    A full disk raises :class:`DiskFullError` saying so; the half-written file is removed and the
    previous checkpoints are left as they were (nothing is pruned before a save succeeds)."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    path = Path(path)
    try:
        with atomic_write(path, "wb") as f:
            torch.save(dict(state), f)
    except (OSError, RuntimeError) as e:
        if not _disk_full(e, path.parent):
            raise
        previous = [p for p in list_checkpoints(path.parent) if p != path]
        kept = (f"the previous checkpoint {previous[-1]} is intact" if previous
                else "no earlier checkpoint exists")
        raise DiskFullError(errno.ENOSPC, f"no space left on the device to write the checkpoint {path} "
                            f"({_free(path.parent)} free); {kept}. Free some disk space (or point --out "
                            "to another disk) and continue with --resume") from e
    if keep_last is not None and _NAME.match(path.name):
        for old in list_checkpoints(path.parent)[:-keep_last]:
            if old != path:
                old.unlink(missing_ok=True)
    return path


def _free(directory: Path) -> str:
    try:
        return f"{shutil.disk_usage(directory).free / 2**20:.0f} MiB"
    except OSError:
        return "unknown space"


def load_checkpoint(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu",
                    weights_only: bool = True) -> dict[str, Any]:
    """Read a checkpoint (tensors land on `map_location`; move the model afterwards).

    A file that is empty, cut short, damaged (a record whose CRC does not match: torch.load does
    not check them) or not a checkpoint at all raises :class:`CheckpointError` naming the file and
    saying what to do (never torch's bare zip or unpickling error)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    advice = ("delete or move it away; a run directory keeps the previous checkpoint beside it, which "
              "--resume then continues from")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"the checkpoint {path} is empty (0 bytes; the write was cut off): {advice}")
    if not zipfile.is_zipfile(path):   # torch.save's format; a cut-off file lacks the zip directory
        raise CheckpointError(f"the checkpoint {path} is truncated or not a torch checkpoint ({size} bytes, "
                              f"no complete zip archive): {advice}")
    try:   # torch.load does not check the archive's CRCs: a flipped bit would load as a value
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"the checkpoint {path} cannot be read ({type(e).__name__}: {e}): "
                              f"{advice}") from e
    if damaged is not None:
        raise CheckpointError(f"the checkpoint {path} is damaged: its record {damaged} fails its CRC "
                              "check (the file changed after it was written: the disk, a copy): "
                              f"{advice}")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as e:  # noqa: BLE001 - every reason to fail is reported the same way, with the file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"the checkpoint {path} cannot be read ({type(e).__name__}: {first[:200]}): "
                              f"{advice}") from e


def _check_training_checkpoint(checkpoint: Any, path: Path) -> dict[str, Any]:
    keys = ("format", "step", "state", "rng", "extra")
    if not isinstance(checkpoint, dict) or any(k not in checkpoint for k in keys):
        held = sorted(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(f"{path} is not a gpipe-repro training checkpoint (it holds {held}, not "
                              f"{list(keys)}): move it out of {path.parent}")
    if checkpoint["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {checkpoint['format']!r}, this version reads "
                              f"{CHECKPOINT_FORMAT}: resume it with the version that wrote it")
    return checkpoint


def load_latest_checkpoint(directory: str | os.PathLike[str], *,
                           warn: Callable[[str], None] | None = None,
                           remove_leftovers: bool = True) -> tuple[dict[str, Any], Path]:
    """The newest readable training checkpoint in `directory` and its path; with
    `remove_leftovers`, the temporary file of a save cut short by a killed process is removed (only
    by the process that holds the run directory: another one's save may be under way).

    A newer file that cannot be read (cut short, empty, foreign) is skipped with a warning naming it,
    and the next older one is used. No checkpoint at all, or none readable, raises naming the
    directory (FileNotFoundError / CheckpointError)."""
    directory = Path(directory)
    for leftover in directory.glob(".step-*.pt.*.tmp") if remove_leftovers else ():
        leftover.unlink(missing_ok=True)                   # a save the killed run never finished
    found = list_checkpoints(directory)
    if not found:
        raise FileNotFoundError(f"--resume: no checkpoint in {directory} (nothing to continue): check "
                                "--name / --out, or leave out --resume to start a new run")
    warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr, flush=True))
    problems = []
    for path in reversed(found):
        try:
            checkpoint = _check_training_checkpoint(load_checkpoint(path), path)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        for problem in problems:
            warn(f"{problem}; resuming from the older {path.name} instead")
        return checkpoint, path
    raise CheckpointError(f"no checkpoint in {directory} can be read:\n  " + "\n  ".join(problems)
                          + "\nstart a new run (another --name / --out), or move the files out of "
                          + str(directory))


# ----------------------------------------------------------------------------- random state

def capture_rng_state() -> dict[str, Any]:
    """The global random streams: Python `random`, numpy's legacy global, torch CPU and CUDA."""
    kind, keys, pos, has_gauss, cached_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": str(kind), "keys": [int(k) for k in keys], "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Undo `capture_rng_state`: the global generators continue exactly where they were captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))  # a loaded checkpoint may hold a list
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) != torch.cuda.device_count():
            raise RuntimeError(f"the checkpoint holds CUDA RNG states for {len(saved)} devices, this "
                               f"process sees {torch.cuda.device_count()}: set CUDA_VISIBLE_DEVICES to "
                               "match the run that saved it")
        torch.cuda.set_rng_state_all([s.cpu() for s in saved])


# ----------------------------------------------------------------------------- run loop state

def training_state(step: int, stateful: Mapping[str, Stateful], *,
                   generators: Mapping[str, torch.Generator] | None = None,
                   extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything a run loop needs to resume at `step`, as one dict for `save_checkpoint`.

    `stateful` maps names to objects with `state_dict()`: the model or GPipe, optimizers,
    scheduler, the batch iterator (data position), the augmentation. `generators` are explicit
    `torch.Generator`s not owned by any of those. `extra` is free-form (config, metrics so far).

    Like `state_dict()`, the result references the live parameter tensors: pass it to
    `save_checkpoint` before the next step (or `copy.deepcopy` it for an in-memory snapshot).
    """
    return {
        "format": CHECKPOINT_FORMAT,
        "step": int(step),
        "state": {name: obj.state_dict() for name, obj in stateful.items()},
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
        "rng": capture_rng_state(),
        "extra": dict(extra or {}),
    }


def restore_training_state(checkpoint: Mapping[str, Any], stateful: Mapping[str, Stateful], *,
                           generators: Mapping[str, torch.Generator] | None = None) -> int:
    """Load a `training_state` dict into the live objects; returns the step to continue from.

    Every name in `stateful`/`generators` must be present in the checkpoint (a silently skipped
    optimizer would resume with fresh momentum).
    """
    if checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint format {checkpoint.get('format')!r} is not {CHECKPOINT_FORMAT}: "
                         "it was not written by gpipe_repro.train.checkpoints.training_state")
    saved, saved_gens = checkpoint["state"], checkpoint["generators"]
    missing = [n for n in stateful if n not in saved] + [n for n in (generators or {}) if n not in saved_gens]
    if missing:
        held = sorted(saved) + sorted(saved_gens)
        raise KeyError(f"checkpoint has no state for {missing}; it holds {held}")
    for name, obj in stateful.items():
        obj.load_state_dict(saved[name])
    for name, gen in (generators or {}).items():
        gen.set_state(saved_gens[name].cpu())
    restore_rng_state(checkpoint["rng"])
    return int(checkpoint["step"])


# ----------------------------------------------------------------------------- resuming

#: A task's settings recorded in checkpoints since a later version: compared where the checkpoint
#: holds them (the training data's fingerprint, :meth:`CausalLMTask.data_fingerprint`).
RECORDED_SINCE = frozenset({"data"})


def check_resumable(saved: dict[str, Any], config: RunConfig, task: Task) -> list[str]:
    """Refuse to resume a checkpoint made with settings that change what the run computes, listing
    every difference. The run's length may change (an explicit `--steps` / `--epochs` extends it):
    that is returned as a note for the caller to print, not refused."""
    run = saved["run"]
    run = {"replicas": 1, **run}          # checkpoints from before --replicas: one pipeline
    def shown(value: Any) -> str:       # None: the option was not given, the task's own choice
        return "not given (the task's default)" if value is None else repr(value)
    diffs = [f"{k}: saved {shown(run.get(k))}, now {shown(getattr(config, k))}" for k in RESUME_MUST_MATCH
             if run.get(k) != getattr(config, k) and not (k == "balance" and getattr(config, k) is None)]
    now, then = task.config(), saved["task"]
    resolved = getattr(task, "resolved_in", {})

    def same_effect(k: str) -> bool:   # given on one side, left to a default of the same effect
        r = resolved.get(k)
        return (r is not None and (then.get(k) is None or now.get(k) is None) and r in then
                and then[r] == now.get(r))
    diffs += [f"{k}: saved {shown(then.get(k))}, now {shown(now.get(k))}"
              for k in sorted(set(now) | set(then)) if then.get(k) != now.get(k)
              and not (k in RECORDED_SINCE and k not in then) and not same_effect(k)]
    if diffs:
        given = any("not given" in d for d in diffs)
        raise ValueError(
            f"cannot resume {config.run_dir}: its checkpoint was made with different settings:\n  "
            + "\n  ".join(diffs) + "\nresume with the original settings"
            + (" (an option the run left to its default is compared as not given: leave it out, "
               "even where you give the default's value)" if given else "")
            + "; to continue another run, give its directory with --out (without --out, --resume "
            "takes the newest runs/<name>[-N] holding checkpoints); or start a new run (leave out "
            "--resume, or another --name / --out)")
    length = [f"{k} {run.get(k)!r} -> {getattr(config, k)!r}" for k in ("steps", "epochs")
              if run.get(k) != getattr(config, k)]
    return [f"the run's length changes ({', '.join(length)}); what depends on the length (the "
            "learning-rate schedule, AmoebaNet's drop-path ramp) follows the new one from here, so the "
            "steps to come differ from a run given this length from the start"] if length else []


# ----------------------------------------------------------------------------- Ctrl-C

class InterruptFlag:
    """Set by the first SIGINT/SIGTERM inside `graceful_interrupt()`; the loop polls `.requested`."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None

    def __bool__(self) -> bool:
        return self.requested


@contextlib.contextmanager
def graceful_interrupt(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)
                       ) -> Iterator[InterruptFlag]:
    """First Ctrl-C (or SIGTERM, e.g. a preempted job): set the flag so the loop can save and exit
    between steps. Second one: raise KeyboardInterrupt right away. Previous handlers are restored on
    exit. Outside the main thread (where Python cannot install handlers) it is a no-op flag.

        with graceful_interrupt() as stop:
            for step in range(start, steps):
                train_step(...)
                if stop.requested:
                    save_checkpoint(...); break
    """
    flag = InterruptFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if flag.requested:
            raise KeyboardInterrupt(f"a second {name}: aborted without saving this step; --resume "
                                    "continues from the last checkpoint saved")
        flag.requested, flag.signal = True, signum
        again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {name} again"
        print(f"\n{name} received: finishing this step, saving, exiting ({again} to abort now)",
              flush=True)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
