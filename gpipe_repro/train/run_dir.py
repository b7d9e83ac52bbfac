"""Where a training run writes, and the rule that nothing a user owns is ever deleted or overwritten.

Three ways to choose the directory (`resolve_run_dir`, used by `gpipe-repro run`):

- by default a **fresh** directory `runs/<name>`, or `runs/<name>-2`, `-3`, ... if that one exists,
  so a run never touches an earlier one nor the repository's published results;
- `--record`: the result of record, `results/training/<name>` (what `make train-amoebanet` does;
  under ``$GPIPE_REPRO_RESULTS`` instead of ``./results`` when set, as every results writer);
- `--out DIR`: exactly DIR, which must be empty, absent, or (with `--overwrite`) a finished previous
  run of the same task.

With `--resume` and no `--out`, the newest `runs/<name>[-N]` holding checkpoints is continued
(`results/training/<name>` with `--record`); none is an error naming where it looked.

Ownership. A run directory holds a manifest, `gpipe-run.json`, listing every file the run created
(checkpoints, metrics, W&B's offline files, summary, curves: the kinds of :func:`is_run_file`; a
file the user adds while it runs is not listed). Starting a new run in the directory of a finished
one of the same task needs `--overwrite` (or `--record`), deletes exactly those files and keeps
everything else; a non-empty
directory without a manifest (or of another task) is refused, naming a few of the files it holds. A
directory written before manifests existed is recognized by its `summary.json` / `run.json`; then only
the loop's own file names count as the run's (`LEGACY_FILES`, `checkpoints/step-*.pt`, W&B's files
and run folders under `wandb/`), and the tables and images its `run.json` lists: a file of the
user's in `images/`, `tables/` or `wandb/` is never the run's (:func:`run_files`).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
from pathlib import Path
from typing import Any

MANIFEST = "gpipe-run.json"
RUNS_DIR = Path("runs")
RESULTS_ENV = "GPIPE_REPRO_RESULTS"     # where results go instead of ./results (report.records')


def record_dir() -> Path:
    """`results/training`, the runs of record: under $GPIPE_REPRO_RESULTS when set."""
    return Path(os.environ.get(RESULTS_ENV) or "results") / "training"
LEGACY_FILES = ("metrics.jsonl", "run.json", "summary.json", "summary.md", "curves.png")
# W&B's own files: its logs and the folder of each run (offline-run-<time>-<id>, run-<time>-<id>)
_WANDB = re.compile(r"^wandb/((offline-)?run-[^/]+/.+|debug\.log|debug-internal\.log|latest-run)$")
#: the trained model for its own tools (a causal LM's transformers folder: save_pretrained's files)
_EXPORT = re.compile(r"^hf/(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors"
                     r"|model\.safetensors\.index\.json)$")
_CHECKPOINT = re.compile(r"^checkpoints/\.?step-\d+\.pt(\..*\.tmp)?$")   # and a save cut short


def _files(run_dir: Path) -> set[str]:
    """Every file (and symlink) under `run_dir`, as POSIX paths relative to it."""
    found: set[str] = set()
    for root, dirs, files in os.walk(run_dir):
        rel = Path(root).relative_to(run_dir)
        for name in files + [d for d in dirs if (Path(root) / d).is_symlink()]:
            found.add((rel / name).as_posix())
    return found


def _read(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def run_owner(run_dir: Path) -> tuple[str | None, set[str]]:
    """(the task of the run that wrote `run_dir`, the files that run created) or (None, set())."""
    manifest = _read(run_dir / MANIFEST)
    if manifest is not None and manifest.get("kind") == "training-run":
        return manifest.get("task"), set(manifest.get("files", [])) | {MANIFEST}
    summary = _read(run_dir / "summary.json") or {}
    run = _read(run_dir / "run.json") or {}
    task = summary.get("task") if summary.get("kind") == "training-run" else None
    task = task or (run.get("config") or {}).get("task_name")
    if task is None:
        return None, set()
    return task, run_files(run_dir, _files(run_dir))


def is_run_file(rel: str) -> bool:
    """Whether a path (relative to a run directory) is named as the training loop names its files:
    its metrics, run record, summary and curves, a checkpoint, W&B's logs and run folders, the
    trained model it exports."""
    return (rel in LEGACY_FILES or rel == MANIFEST or bool(_CHECKPOINT.match(rel))
            or bool(_WANDB.match(rel)) or bool(_EXPORT.match(rel)))


def is_export_file(rel: str) -> bool:
    """Whether a path (relative to a run directory) is named as a file of the trained model's export
    (``hf/``). Such a file is the run's only where its manifest lists it or the run wrote it now:
    the export comes last, and a folder ``hf/`` the user filled in the meantime stays theirs."""
    return bool(_EXPORT.match(rel))


def run_files(run_dir: Path, files: set[str]) -> set[str]:
    """Those of `files` (relative to `run_dir`) that a training run wrote: named as it names its
    files (:func:`is_run_file`), or a table or image its ``run.json`` lists (the RunLogger's
    ``tables/`` and ``images/``). A file the user put in those folders is neither."""
    record = _read(run_dir / "run.json") or {}
    logged = {Path(v).as_posix() for key in ("tables", "images")
              for v in (record.get(key) or {}).values() if isinstance(v, str)}
    return {f for f in files if is_run_file(f) or f in logged}


def _has_checkpoints(run_dir: Path) -> bool:
    return any((run_dir / "checkpoints").glob("step-*.pt")) if (run_dir / "checkpoints").is_dir() else False


def _finished(run_dir: Path) -> bool:
    return (_read(run_dir / "summary.json") or {}).get("status") == "finished"


def check_run_dir(run_dir: Path, task: str, *, resume: bool, overwrite: bool = False) -> None:
    """Raise (changing nothing) unless a run of `task` may write into `run_dir`.

    A resumed run needs a checkpoint there; a new one needs the directory absent, empty, or a
    finished previous run of the same task whose files it may replace (`overwrite`: the user's
    ``--overwrite``, or ``--record``, the make target's way to renew the result of record); it then
    replaces those files and only those.
    """
    if resume:
        if not _has_checkpoints(run_dir):
            raise FileNotFoundError(
                f"--resume: no checkpoint in {run_dir / 'checkpoints'} (nothing to continue): check "
                "--name / --out, or leave out --resume to start a new run")
        owner, _ = run_owner(run_dir)
        if owner is not None and owner != task:
            raise FileExistsError(f"--resume: {run_dir} holds a `{owner}` run, not a `{task}` run")
        return
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise FileExistsError(f"{run_dir} is a file, not a directory: choose another --out")
    present = _files(run_dir)
    if not present:
        return
    owner, ours = run_owner(run_dir)
    if owner != task:
        shown = ", ".join(sorted(present)[:4]) + (", ..." if len(present) > 4 else "")
        what = "is not a previous training run" if owner is None else f"holds a `{owner}` run"
        raise FileExistsError(
            f"{run_dir} {what} and is not empty ({len(present)} files: {shown}); nothing was "
            f"changed. Give --out an empty or new directory, or leave out --out to write to a fresh "
            f"{RUNS_DIR}/<name>-N")
    if _has_checkpoints(run_dir) and not _finished(run_dir):
        newest = sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1].name
        raise FileExistsError(
            f"{run_dir} holds an unfinished run (checkpoints up to {newest}): continue it with "
            "--resume, or choose another --name / --out")
    if not overwrite:
        raise FileExistsError(
            f"{run_dir} holds a previous `{task}` run ({len(ours & present)} files: its checkpoints, "
            "metrics and logs); nothing was changed. Pass --overwrite to replace it (only its own "
            "files go; yours stay), give another --out, or leave out --out for a fresh "
            f"{RUNS_DIR}/<name>-N")


def clear_run(run_dir: Path, also: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Delete what a previous run created in `run_dir` (its manifest's files, checkpoints included,
    finished or not, and `also`) and nothing else; empty folders it made inside go too, never
    `run_dir` itself. Returns the files deleted."""
    if not run_dir.is_dir():
        return []
    present = _files(run_dir)
    _, ours = run_owner(run_dir)
    ours = ours | set(also)
    deleted = sorted(ours & present)
    for rel in deleted:
        (run_dir / rel).unlink(missing_ok=True)
    for root, dirs, _ in sorted(os.walk(run_dir), key=lambda t: -len(t[0])):
        for d in dirs:
            candidate = Path(root) / d
            rel = candidate.relative_to(run_dir).as_posix()
            if any(f.startswith(rel + "/") for f in ours) and not any(candidate.iterdir()):
                candidate.rmdir()
    return deleted            # the directory itself stays: it may be the user's (owner, mode, a link)


class RunDirectory:
    """A run directory this process writes (rank 0 only): claimed, and its manifest kept current."""

    def __init__(self, path: Path, task: str, *, resume: bool, overwrite: bool = False) -> None:
        """Check (`check_run_dir`), then make the directory ready: a new run deletes the files of
        the finished previous run it replaces (those listed in its manifest) and nothing else."""
        check_run_dir(path, task, resume=resume, overwrite=overwrite)   # before making anything
        self.path, self.task = path, task
        self.created = not path.exists()     # by this run: removed again if it never starts
        what = "give --out a directory this user can write, or --name for a fresh runs/<name>"
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"cannot write the run directory {path} ({e.strerror}): {what}") from e
        if not os.access(path, os.W_OK):     # read-only (a mount, or a mode), before any work
            raise PermissionError(errno.EACCES, f"cannot write the run directory {path}: {what}")
        self._lock: int | None = _claim(path)
        try:                                 # again, now that no other process can change it
            check_run_dir(path, task, resume=resume, overwrite=overwrite)
        except BaseException:
            self.release()
            if self.created and not any(path.iterdir()):
                path.rmdir()
            raise
        present = _files(path)
        owner, ours = run_owner(path) if present else (None, set())
        if owner == task:     # a run killed before its manifest listed them: still the run's
            ours |= {f for f in run_files(path, present) if not is_export_file(f)}
        if not resume:
            clear_run(path, ours)
        self.foreign = (present - ours) if present else set()
        self.kept = ours if resume else set()     # a resumed run's files so far stay listed
        self.exported: set[str] = set()           # the export's files this run wrote (claim)
        self.update()

    def release(self) -> None:
        """Let another process write the directory (the run has ended; so does dropping this object,
        or the process's exit)."""
        if getattr(self, "_lock", None) is not None:
            os.close(self._lock)       # type: ignore[arg-type]
            self._lock = None

    def __del__(self) -> None:
        self.release()

    def abandon(self) -> None:
        """A new run that failed before its first step (a bad option found while building the model,
        say): remove the files it wrote, and the directory if it created it, rather than leave a run
        of nothing behind (a runs/<name>-N that :func:`fresh_run_dir` claimed goes with
        :func:`release_unused_claims`)."""
        self.release()
        for rel in sorted(run_files(self.path, _files(self.path) - self.foreign) | {MANIFEST}):
            (self.path / rel).unlink(missing_ok=True)
        if self.created and not any(self.path.iterdir()):
            self.path.rmdir()

    def ours_in(self, folder: str) -> tuple[set[str], list[str]]:
        """The files now under `folder` (relative to the run directory) that the run wrote or its
        manifest lists, and those it did not (the user's), as paths relative to `folder`."""
        inside = {f for f in _files(self.path) if f.startswith(folder + "/")}
        mine = inside & (self.kept | self.exported)
        return ({f[len(folder) + 1:] for f in mine},
                sorted(f[len(folder) + 1:] for f in inside - mine))

    def claim(self, folder: str) -> None:
        """Every file now under `folder` is the run's (it has just written them there)."""
        self.exported |= {f for f in _files(self.path) if f.startswith(folder + "/")}

    def update(self) -> None:
        """Rewrite the manifest: every file the run wrote (:func:`run_files`) now under the directory
        that was not there before the run, with those of the run it resumed. A file the user puts
        there while the run trains (notes, a plot, even in ``images/``) is not the run's, and a
        later run must not delete it."""
        new = _files(self.path) - self.foreign
        named = {f for f in run_files(self.path, new) if not is_export_file(f)}
        files = sorted(named | ((self.kept | self.exported) & new) | {MANIFEST})
        tmp = self.path / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"kind": "training-run", "task": self.task, "files": files}, indent=1))
        os.replace(tmp, self.path / MANIFEST)


def _claim(path: Path) -> int:
    """An exclusive lock on the directory `path` for this process (``flock`` on the directory
    itself: no file of ours in it), or FileExistsError when another process holds it: two runs, or
    a run and its --resume, writing one directory at once would interleave their metrics and
    checkpoints."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FileExistsError(f"{path}: another process is writing this run directory (a run, or a "
                              "--resume of it); nothing was changed. Wait for it to end, or give "
                              "another --out / --name") from None
    return fd


def numbered(base: Path, name: str) -> list[Path]:
    """`base/name`, `base/name-2`, ... that exist, oldest first."""
    found = []
    if (base / name).is_dir():
        found.append((1, base / name))
    pattern = re.compile(rf"^{re.escape(name)}-(\d+)$")
    if base.is_dir():
        found += [(int(m.group(1)), p) for p in base.iterdir() if (m := pattern.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def fresh_run_dir(name: str, base: Path = RUNS_DIR) -> Path:
    """`base/name` if it does not exist yet, else `base/name-N` with N one above the highest;
    claimed (created, empty) here, atomically: two runs started together (a seed sweep) got the
    same directory when the name was chosen here and the directory made later, and the second
    deleted the first's files."""
    existing = numbered(base, name)
    n = 0
    if existing:
        last = existing[-1].name
        n = int(last.rsplit("-", 1)[1]) if last != name else 1
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # under torchrun every rank runs the command and must name the same directory: chosen, not
        # claimed (rank 0 creates it); runs started together must then be given --name or --out
        return base / (name if n == 0 else f"{name}-{n + 1}")
    made = [p for p in (base, *base.parents) if not p.exists()]     # runs/, if this run makes it
    base.mkdir(parents=True, exist_ok=True)
    _claimed.extend(reversed(made))
    while True:
        candidate = base / (name if n == 0 else f"{name}-{n + 1}")
        try:
            candidate.mkdir()
            _claimed.append(candidate)
            return candidate
        except FileExistsError:
            n += 1


_claimed: list[Path] = []   # the directories fresh_run_dir claimed in this process


def release_unused_claims() -> None:
    """Remove the directories :func:`fresh_run_dir` claimed in this process that are still empty: a
    run refused after its directory was chosen (a size transformers rejects, too small micro-batches)
    leaves no empty runs/<name>-N behind, nor an empty runs/ it made."""
    while _claimed:
        path = _claimed.pop()
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def is_plain_folder_name(name: str) -> bool:
    """One folder name, no path in it (no '/', no leading '.')."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name \
        and not name.startswith(".")


def check_run_name(name: str) -> None:
    """A run name is one folder name under runs/ (or results/training/): no path in it."""
    if not is_plain_folder_name(name):
        raise ValueError(f"--name {name!r} is not a plain folder name (no '/', no leading '.'): the "
                         "run writes to runs/<name>; use --out DIR to write anywhere else")


def resolve_run_dir(name: str, *, out: str | None, record: bool, resume: bool) -> Path:
    """The directory a `gpipe-repro run` writes to (see the module docstring)."""
    check_run_name(name)
    if out is not None and record:
        raise ValueError("--record writes the result of record to results/training/<name>; --out "
                         "writes elsewhere: give one of them")
    if out is not None:
        path = Path(out)
        blocked = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocked is not None:
            raise ValueError(f"--out {out}: {blocked} is a file, not a directory; give a directory "
                             "(new, or one of this run's)")
        return path
    if record:
        return record_dir() / name
    if resume:
        candidates = [p for p in numbered(RUNS_DIR, name) if _has_checkpoints(p)]
        if not candidates:
            raise FileNotFoundError(
                f"--resume: no run named {name!r} with checkpoints in {RUNS_DIR.resolve()} (looked for "
                f"{RUNS_DIR / name} and {RUNS_DIR / name}-N): check --name, give the run's directory "
                "with --out, or leave out --resume to start a new run")
        return candidates[-1]
    return fresh_run_dir(name)
