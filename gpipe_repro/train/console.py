"""Console stand-ins for the run loop: the progress bar (or a silent stand-in when it is off, in
tests and logs) and the logger of ranks that do not write (every rank but 0 in a distributed run)."""
from __future__ import annotations

from typing import Any


class NoLogger:
    """What ranks other than 0 log to: nothing."""

    metrics_path = None

    def log(self, *args: Any, **kwargs: Any) -> None:
        return None

    def finish(self, *args: Any, **kwargs: Any) -> None:
        return None


class NoProgress:
    """Stand-in for rich.progress.Progress when there is no live bar: the bar is off
    (``--no-progress``), or the output is not a terminal (a log file, nohup, CI), where a live bar
    prints nothing until the end. Unless `quiet` (ranks other than 0), it prints a plain line every
    `every_s` seconds (step, loss, samples/s, elapsed, ETA), so a long run is never silent for long.
    ``every_s=0``: never (tests)."""

    def __init__(self, quiet: bool = True, every_s: float = 30.0) -> None:
        from rich.console import Console
        self.console = Console(quiet=quiet, soft_wrap=True, highlight=False)
        self.quiet, self.every_s = quiet, every_s
        self._total: float | None = None
        self._start_step = 0
        self._t0 = self._last = 0.0

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str = "", *, total: float | None = None, completed: int = 0,
                 **fields: Any) -> int:
        import time
        self._total, self._start_step = total, completed
        self._t0 = self._last = time.monotonic()
        return 0

    def update(self, task: int = 0, *, completed: int | None = None, loss: float | None = None,
               rate: float | None = None, **fields: Any) -> None:
        import time
        now = time.monotonic()
        if self.quiet or not self.every_s or completed is None or now - self._last < self.every_s:
            return
        self._last = now
        elapsed = now - self._t0
        done = completed - self._start_step
        left = ((self._total - completed) * elapsed / done) if self._total and done > 0 else None
        total = f"/{int(self._total)}" if self._total else ""
        self.console.print(f"step {completed}{total}"
                           + (f" loss {loss:.4f}" if loss is not None else "")
                           + (f" {rate:.1f} samples/s" if rate else "")
                           + f" elapsed {_clock(elapsed)}"
                           + (f" eta {_clock(left)}" if left is not None else ""))


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress_bar(enabled: bool, *, quiet: bool = False, every_s: float = 30.0) -> Any:
    """A rich progress bar for the run (steps, loss, samples/s, ETA) on a terminal; elsewhere, or
    when not `enabled`, `NoProgress`, whose console still prints the run's lines (evaluations,
    checkpoints, interruption) and a progress line every `every_s` seconds, unless `quiet` (ranks
    other than 0)."""
    import sys
    if not enabled or not sys.stdout.isatty():
        return NoProgress(quiet=quiet, every_s=every_s)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}"),
                    TextColumn("{task.fields[rate]:.1f} samples/s"), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn())
