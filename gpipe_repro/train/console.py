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
    """Stand-in for rich.progress.Progress when the bar is off (tests, logs)."""

    def __init__(self, quiet: bool = True) -> None:
        from rich.console import Console
        self.console = Console(quiet=quiet, soft_wrap=True, highlight=False)

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None


def progress_bar(enabled: bool, *, quiet: bool = False) -> Any:
    """A rich progress bar for the run (steps, loss, samples/s, ETA), or `NoProgress`, whose console
    still prints the run's lines (evaluations, interruption) unless `quiet` (ranks other than 0)."""
    if not enabled:
        return NoProgress(quiet=quiet)
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
