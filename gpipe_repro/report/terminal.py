"""Where the commands print their tables: a rich Console as wide as the terminal, or, written to a file
or a pipe, wide enough that no column is cut to an ellipsis (rich assumes 80 columns there)."""
from __future__ import annotations

from typing import Any

__all__ = ["table_console"]


def table_console() -> Any:
    """The Console a command prints its tables to (see the module docstring)."""
    from rich.console import Console
    out = Console()
    return out if out.is_terminal else Console(width=max(out.width, 200))
