"""The `gpipe-repro` command line: every module in `gpipe_repro.commands` adds its commands.

The command line is an extra (`pip install 'gpipe-repro[cli]'`: typer and rich); the engine does not
need it. Without typer, `gpipe-repro` prints one line saying what to install and exits with 2.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import Any

# modules of gpipe_repro.commands that the commands share, not commands (so are those named `_*`)
HELPERS = frozenset({"options"})
MISSING_CLI = "gpipe-repro: the command line needs typer and rich: pip install 'gpipe-repro[cli]'"


def build_app() -> Any:
    """The typer app with every command registered."""
    import typer

    import gpipe_repro.commands as commands

    app = typer.Typer(add_completion=False, no_args_is_help=True,
                      help="GPipe pipeline-parallel training and the GPipe paper's experiments.")

    @app.callback()
    def _root() -> None:
        """GPipe pipeline-parallel training and the GPipe paper's experiments."""

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.name in HELPERS:
            continue
        importlib.import_module(f"{commands.__name__}.{info.name}").register(app)
    return app


_app: Any = None


def __getattr__(name: str) -> Any:
    """`gpipe_repro.cli.app`: the typer app, built on first use."""
    global _app
    if name == "app":
        if _app is None:
            _app = build_app()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    try:
        import rich  # noqa: F401
        import typer  # noqa: F401
    except ModuleNotFoundError:
        print(MISSING_CLI, file=sys.stderr)
        sys.exit(2)
    try:
        __getattr__("app")()
    except KeyboardInterrupt as e:   # a Ctrl-C no command turned into a graceful stop: one line
        print(f"\ninterrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        sys.exit(130)
