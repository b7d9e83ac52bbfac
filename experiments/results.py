"""`make results`: every table and validation page of record, regenerated from a clean commit.

The driver is :mod:`gpipe_repro.repro.results`; this is its command line.
"""
from __future__ import annotations

import typer

from gpipe_repro.repro import results

app = typer.Typer(add_completion=False)


@app.command()
def main(dry_run: bool = typer.Option(False, "--dry-run", help="print each part's limit and command; "
                                      "run nothing")) -> None:
    """Every table and validation page of record, regenerated from a clean commit (<= 45 minutes)."""
    results.main(dry_run=dry_run)


if __name__ == "__main__":
    app()
