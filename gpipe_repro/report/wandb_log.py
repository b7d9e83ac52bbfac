"""One logger for every experiment and the training loop: Weights & Biases plus local files.

Why both. W&B gives dashboards, but this project must run with no network and its tables are built
from local data; so every metric, table, image and summary also lands under the run's results
directory, whatever the W&B mode:

    <dir>/metrics.jsonl      one line per `log` call: {"step": ..., "wall_time": unix s, metrics...}
    <dir>/run.json           config, summary, tables, images, status, environment (atomic rewrite)
    <dir>/tables/<name>.json each `log_table`
    <dir>/wandb/             W&B's own run directory (offline runs: sync later with `wandb sync`)

Modes. `mode` defaults to $WANDB_MODE, else "offline" (this project's default: nothing leaves the
machine unless asked). "disabled" never imports wandb (local files only). "online" needs an API key
(WANDB_API_KEY or `wandb login`); without one it fails at once with a message saying what to do,
instead of prompting or hanging. The usual WANDB_* variables are respected: WANDB_PROJECT overrides
`project`, WANDB_DIR overrides where W&B writes, WANDB_ENTITY / WANDB_RUN_GROUP / WANDB_TAGS /
WANDB_NAME are read by wandb itself, and WANDB_SILENT / WANDB_CONSOLE / WANDB_X_DISABLE_STATS ...
keep their meaning (our quiet defaults apply only where the variable is unset).

Why those defaults: system-stats sampling is a background process polling the machine every few
seconds, and console capture wraps stdout; on a 2-core CPU benchmark both are noise we do not want,
and the numbers we care about are logged explicitly. Measured here (2 cores, offline, busy machine):
the first run of a process takes about 2.5 s to init (importing wandb and starting its wandb-core
service), later runs about 0.15 s; finish takes about 0.02 s.

Resuming: pass `resume_step=` (the checkpoint's step) and the same `dir`; rows at or after that step
are dropped from metrics.jsonl (they will be logged again), and W&B continues the same run id.
"""
from __future__ import annotations

import json
import math
import netrc
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from gpipe_repro.report.records import atomic_write, write_json

MODES = ("online", "offline", "disabled")
_MODE_ALIASES = {"dryrun": "offline", "run": "online"}

# Our quiet defaults (wandb.Settings fields), each applied only when no WANDB_* variable sets it.
_QUIET_SETTINGS: dict[str, Any] = {
    "silent": True,
    "console": "off",
    "x_disable_stats": True,
    "x_disable_meta": True,
    "x_disable_machine_info": True,
    "disable_git": True,      # environment() records the commit already
    "save_code": False,
}


class RunLogger:
    """Log metrics, tables, images and a summary to W&B and to local files under `dir`."""

    def __init__(self, project: str, config: Mapping[str, Any] | None = None, *,
                 mode: str | None = None, dir: str | os.PathLike[str] = "results/runs",
                 name: str | None = None, group: str | None = None,
                 tags: Sequence[str] | None = None, resume_step: int | None = None) -> None:
        self.mode = resolve_mode(mode)
        self.project = os.environ.get("WANDB_PROJECT", project)
        self.config = dict(config or {})
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self._summary: dict[str, Any] = {}
        self._tables: dict[str, str] = {}
        self._images: dict[str, str] = {}
        self._finished = False
        previous = _read_run_json(self.dir / "run.json") if resume_step is not None else {}
        if resume_step is not None:
            _truncate_metrics(self.metrics_path, resume_step)
            self._summary = dict(previous.get("summary", {}))
            self._tables = dict(previous.get("tables", {}))
            self._images = dict(previous.get("images", {}))
        self._run: Any = None
        self.init_seconds = 0.0
        if self.mode != "disabled":
            t0 = time.perf_counter()
            self._run = _init_wandb(self.mode, self.project, self.config, name=name, group=group,
                                    tags=tags, wandb_dir=Path(os.environ.get("WANDB_DIR", self.dir)),
                                    run_id=previous.get("wandb_id"))
            self.init_seconds = time.perf_counter() - t0
        self._write_run_json("running")

    # ------------------------------------------------------------------ logging

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log scalar metrics (numbers or strings; tensors/numpy scalars are converted)."""
        row = {k: _scalar(v, k) for k, v in metrics.items()}
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "wall_time": round(time.time(), 3), **row}) + "\n")
        if self._run is not None:
            self._run.log(row, step=step)

    def log_table(self, name: str, headers: Sequence[str], rows: Sequence[Sequence[Any]],
                  method: str | None = None) -> Path:
        """A table (e.g. one row per configuration): local JSON, and a wandb.Table. `method`
        ("measured" / "simulated") is recorded when the whole table is one or the other."""
        headers = [str(h) for h in headers]
        rows = [[_scalar(c, name) for c in row] for row in rows]
        path = write_json(self.dir / "tables" / f"{_safe(name)}.json",
                          {"name": name, **({"method": method} if method else {}),
                           "headers": headers, "rows": rows})
        self._tables[name] = str(path.relative_to(self.dir))
        if self._run is not None:
            import wandb
            self._run.log({name: wandb.Table(columns=list[str | int](headers), data=rows)})
        self._write_run_json("running")
        return path

    def log_image(self, name: str, png_path: str | os.PathLike[str]) -> None:
        """An image file (a Gantt chart, a plot): recorded locally, uploaded as a wandb.Image."""
        png_path = Path(png_path)
        if not png_path.is_file():
            raise FileNotFoundError(f"log_image({name!r}): no file at {png_path}")
        local = png_path
        if self.dir.resolve() not in png_path.resolve().parents:
            local = self.dir / "images" / png_path.name
            local.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png_path, local)
        self._images[name] = str(local.resolve().relative_to(self.dir.resolve()))
        if self._run is not None:
            import wandb
            self._run.log({name: wandb.Image(str(png_path))})
        self._write_run_json("running")

    def summary(self, values: Mapping[str, Any]) -> None:
        """Final numbers of the run (best accuracy, mean step time, ...)."""
        values = {k: _scalar(v, k) for k, v in values.items()}
        self._summary.update(values)
        if self._run is not None:
            self._run.summary.update(values)
        self._write_run_json("running")

    def finish(self, exit_code: int = 0) -> None:
        """Close the W&B run and mark run.json "finished" (or "failed" for a non-zero exit code)."""
        if self._finished:
            return
        self._finished = True
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
        self._write_run_json("finished" if exit_code == 0 else "failed")

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)

    @property
    def wandb_run_dir(self) -> Path | None:
        """W&B's directory for this run (None when disabled)."""
        return None if self._run is None else Path(self._run.dir).parent

    # ------------------------------------------------------------------ local files

    def _write_run_json(self, status: str) -> None:
        write_json(self.dir / "run.json", {
            "project": self.project,
            # A run's metrics are what happened on this machine: measured, never simulated.
            "method": "measured",
            "mode": self.mode,
            "status": status,
            "wandb_id": None if self._run is None else self._run.id,
            "wandb_dir": None if self._run is None else str(self.wandb_run_dir),
            "config": self.config,
            "summary": self._summary,
            "tables": self._tables,
            "images": self._images,
            "metrics": self.metrics_path.name,
            "wandb_init_seconds": round(self.init_seconds, 3),
        })


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, in logging order. A last line cut off (the disk filled up, or
    the power went, while it was written: each row is one write, so nothing else tears) is left
    out; an unreadable line before the last is an error naming the file and the line."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            if number == len(lines):      # no newline after it: the last write was cut off
                continue
            raise ValueError(f"{path}, line {number}, is not a JSON row ({e}): repair or remove that "
                             "line, then run again") from e
    return rows


def resolve_mode(mode: str | None) -> str:
    """The W&B mode to use: the argument, else $WANDB_MODE, else "offline"."""
    chosen = (mode or os.environ.get("WANDB_MODE") or "offline").strip().lower()
    chosen = _MODE_ALIASES.get(chosen, chosen)
    if chosen not in MODES:
        raise ValueError(f"unknown W&B mode {chosen!r}: use one of {MODES} (argument or WANDB_MODE)")
    return chosen


def has_api_key() -> bool:
    """True if W&B credentials are configured: WANDB_API_KEY, or a ~/.netrc entry for the host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    for path in (os.environ.get("NETRC"), Path.home() / ".netrc", Path.home() / "_netrc"):
        if path and Path(path).is_file():
            try:
                if netrc.netrc(path).authenticators(host or ""):
                    return True
            except (netrc.NetrcParseError, OSError):
                continue
    return False


def _init_wandb(mode: str, project: str, config: Mapping[str, Any], *, name: str | None,
                group: str | None, tags: Sequence[str] | None, wandb_dir: Path,
                run_id: str | None) -> Any:
    if mode == "online" and not has_api_key():
        raise RuntimeError("WANDB_MODE=online but no W&B API key is configured: set WANDB_API_KEY or "
                           "run `wandb login`, or log locally with WANDB_MODE=offline (sync later "
                           "with `wandb sync`) or WANDB_MODE=disabled")
    import wandb

    settings = {key: value for key, value in _QUIET_SETTINGS.items() if not _set_by_env(key)}
    wandb_dir.mkdir(parents=True, exist_ok=True)
    try:
        return wandb.init(project=project, config=dict(config),
                          mode=mode,  # type: ignore[arg-type]  # one of WANDB_MODES, checked by the caller
                          dir=str(wandb_dir),
                          name=name, group=group, tags=list(tags) if tags else None,
                          id=run_id, resume="allow" if run_id else None,
                          settings=wandb.Settings(**settings))
    except (wandb.errors.UsageError, wandb.errors.AuthenticationError, wandb.errors.CommError) as e:
        raise RuntimeError(f"W&B {mode} init failed: {e}. Check WANDB_API_KEY / network, or use "
                           "WANDB_MODE=offline or WANDB_MODE=disabled") from e


def _set_by_env(setting: str) -> bool:
    """Whether a WANDB_* variable sets this wandb.Settings field (WANDB_SILENT -> silent,
    WANDB_X_DISABLE_STATS or WANDB__DISABLE_STATS -> x_disable_stats, ...)."""
    names = {f"WANDB_{setting.upper()}"}
    if setting.startswith("x_"):
        names.add(f"WANDB__{setting[2:].upper()}")
    if setting == "save_code":
        names.add("WANDB_DISABLE_CODE")
    return any(name in os.environ for name in names)


def _scalar(value: Any, key: str) -> Any:
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return value  # json writes NaN/Infinity; a diverged loss must be visible, not dropped
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"metric {key!r} is a {type(value).__name__}: log numbers or strings "
                    "(use log_table for rows, log_image for pictures)")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _read_run_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def _truncate_metrics(path: Path, resume_step: int) -> None:
    """Drop rows logged at or after `resume_step` (they happened after the checkpoint)."""
    if not path.is_file():
        return
    kept = [row for row in read_metrics(path) if row.get("step") is None or row["step"] < resume_step]
    with atomic_write(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in kept)
