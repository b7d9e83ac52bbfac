"""Where the simulator's step time departs from a real run's, per stage and action kind.

The diagnostic is :mod:`gpipe_repro.repro.cost_model_gap`; this is its command line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpipe_repro.repro.cost_model_gap import MODELS, gap, render

app = typer.Typer(add_completion=False)


@app.command()
def main(model: str = typer.Option("residual", help=f"one of {', '.join(MODELS)}"),
         k: int = typer.Option(2, "--k", min=1), m: int = typer.Option(8, "--m", min=1),
         microbatch: int = typer.Option(32, min=1),
         checkpoint: str = typer.Option("always", help="never, always or except_last"),
         steps: int = typer.Option(4, min=1), repeats: int = typer.Option(10, min=1),
         out: Optional[Path] = typer.Option(None, help="write the result as JSON here")) -> None:
    """Where the simulator's step time departs from a real run's, per stage and action kind."""
    if model not in MODELS:
        raise typer.BadParameter(f"{model!r}: use one of {', '.join(MODELS)}", param_hint="--model")
    if checkpoint not in ("never", "always", "except_last"):
        raise typer.BadParameter(f"{checkpoint!r}: use never, always or except_last",
                                 param_hint="--checkpoint")
    result = gap(model, k=k, m=m, microbatch=microbatch, checkpoint=checkpoint, steps=steps,
                 repeats=repeats)
    print(render(result), flush=True)
    if out is not None:
        from gpipe_repro.report.records import write_json
        write_json(out, result)


if __name__ == "__main__":
    app()
