"""What every thin script here does: run one `gpipe-repro` command, with this script's arguments.

The make targets call ``python -m experiments.<name>``; each such script is
``run("<command>", <the make target's own flags>)``, so the Makefile, the command line and the
experiments run the same typer command and cannot drift apart.
"""
from __future__ import annotations

import sys


def run(command: str, *flags: str) -> None:
    """`gpipe-repro COMMAND FLAGS... ARGS...`, ARGS being this process's command-line arguments."""
    from gpipe_repro.cli import app

    app([command, *flags, *sys.argv[1:]], prog_name="gpipe-repro")
