"""`make device-results`: a lent GPU host's results in at most 8 minutes (``--tiny``: toy sizes on a CPU).

The driver is :mod:`gpipe_repro.repro.device_results`; this is its command line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpipe_repro.repro import device_results

app = typer.Typer(add_completion=False)


@app.command()
def main(tiny: bool = typer.Option(False, "--tiny", help="toy sizes on the CPU, K=2 and R=2 only, no GPU"),
         out: Optional[Path] = typer.Option(None, help="output folder (default: $OUT, else "
                                            "results/hosts/<host>/)"),
         dry_run: bool = typer.Option(False, "--dry-run", help="print the plan; run nothing")) -> None:
    """A lent GPU host: host speed, gpu-check, validate-sim K=2/4/8, schedules K=4, replicas R=2/4."""
    device_results.main(tiny=tiny, out=out, dry_run=dry_run)


if __name__ == "__main__":
    app()
