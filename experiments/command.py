"""What the scripts here share: `run`, one `gpipe-repro` command with this script's arguments, and
the benchmarks' stop-rule options.

The make targets call ``python -m experiments.<name>``; each such script is
``run("<command>", <the make target's own flags>)``, so the Makefile, the command line and the
experiments run the same typer command and cannot drift apart; a script that is no `gpipe-repro`
command (a benchmark of this checkout) is a typer command itself.
"""
from __future__ import annotations

import sys
from typing import Annotated

import typer


def run(command: str, *flags: str) -> None:
    """`gpipe-repro COMMAND FLAGS... ARGS...`, ARGS being this process's command-line arguments."""
    from gpipe_repro.cli import app

    app([command, *flags, *sys.argv[1:]], prog_name="gpipe-repro")


# The stop rule of a benchmark's measurement rounds (gpipe_repro.repro.harness.stop_rule): each
# benchmark gives its own defaults, e.g. ``budget: Budget = 120.0``.
Budget = Annotated[float, typer.Option("--budget", min=0.0, help="seconds of measuring for the whole "
                                       "run, shared by its groups; a busy host reaches it with wider "
                                       "intervals")]
Tolerance = Annotated[float, typer.Option("--tolerance", min=0.0, help="relative half-width of the 95% "
                                          "interval at which rounds stop")]
MinRounds = Annotated[int, typer.Option("--min-rounds", min=1, help="rounds before the rounds may stop")]
MaxRounds = Annotated[int, typer.Option("--max-rounds", min=1, help="rounds at most")]
Write = Annotated[bool, typer.Option("--write/--no-write", help="write the page and its JSON under "
                                     "results/ (--no-write: print only)")]
