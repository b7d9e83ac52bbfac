"""The `gpipe-repro` command line."""
import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


def main() -> None:
    app()
