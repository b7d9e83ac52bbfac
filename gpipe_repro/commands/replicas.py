"""`gpipe-repro throughput`: simulated samples/s and time breakdown of K x R devices (R pipeline
replicas), e.g. ``gpipe-repro throughput --k 8 --replicas 128 --m 32``.

Options pass through to :mod:`gpipe_repro.repro.replicas_throughput` (``--help`` there lists them).
"""
from __future__ import annotations

import typer

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def register(app: typer.Typer) -> None:
    """Add the command to the `gpipe-repro` app."""
    @app.command("throughput", context_settings=_PASS_THROUGH, add_help_option=False)
    def throughput(ctx: typer.Context) -> None:
        """Simulated throughput of R replicas of a K-stage pipeline: pipeline, data-parallel
        all-reduce (ring or tree; NVLink in a host, InfiniBand between hosts) and their overlap
        (options: --model, --k, --replicas, --m, --microbatch, --device, --algorithm; --help)."""
        from gpipe_repro.repro.replicas_throughput import main

        main(list(ctx.args), prog="gpipe-repro throughput")
