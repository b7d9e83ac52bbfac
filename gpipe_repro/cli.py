"""The `gpipe-repro` command line: every module in `gpipe_repro.commands` adds its commands."""
from __future__ import annotations

import importlib
import pkgutil

import typer

import gpipe_repro.commands as _commands

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="GPipe pipeline-parallel training and the GPipe paper's experiments.")


@app.callback()
def _root() -> None:
    """GPipe pipeline-parallel training and the GPipe paper's experiments."""


for _info in sorted(pkgutil.iter_modules(_commands.__path__), key=lambda i: i.name):
    if _info.name.startswith("_"):     # helpers shared by the commands (e.g. _vocabulary)
        continue
    importlib.import_module(f"{_commands.__name__}.{_info.name}").register(app)


def main() -> None:
    app()
