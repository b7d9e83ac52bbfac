"""One vocabulary for every command: the same flag for the same thing, everywhere.

    --k / -k          K, partitions (cells, one per device)
    --m / -m          M, micro-batches per mini-batch
    --batch-size      examples per mini-batch
    --devices         devices available (plan)
    --memory          memory per device, GiB
    --out             where a command writes (a run directory, or a JSON file for fit / plan)

Spellings that earlier versions accepted (`--partitions` / `-K`, `--micro-batches` / `-M`, `--batch`,
`--json`) still work as hidden aliases, so nothing a user typed breaks; `alias` declares one and
`resolve` merges it with the documented flag (giving both with different values is an error).
Each command module declares its options with these names; tests/commands/test_run.py checks that every
command line in README.md parses.
"""
from __future__ import annotations

from typing import Any

import typer

HELP = {
    "k": "K: partitions (cells, one per device)",
    "m": "M: micro-batches per mini-batch",
    "batch_size": "examples per mini-batch (one synchronous update)",
    "devices": "devices available (K is at most this)",
    "memory": "memory per device, GiB",
}


def alias(*names: str) -> Any:
    """A hidden option accepting an older spelling (merged by `resolve`)."""
    return typer.Option(None, *names, hidden=True)


def resolve(flag: str, value: Any, old: Any, old_flag: str, default: Any = None) -> Any:
    """The documented flag's value, else its hidden alias's, else `default`."""
    if value is not None and old is not None and value != old:
        raise typer.BadParameter(f"{flag} {value} and {old_flag} {old} disagree; {old_flag} is an older "
                                 f"spelling of {flag}: give only {flag}")
    if value is not None:
        return value
    return old if old is not None else default


def positive(flag: str, value: int | float | None, what: str = "") -> None:
    """Refuse a count or size below 1 (before any work), saying what it means."""
    if value is not None and value < 1:
        raise typer.BadParameter(f"{flag} must be >= 1{f' ({what})' if what else ''}, got {value}")
