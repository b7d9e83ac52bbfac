"""`gpipe-repro gpu-check`: the engine, the memory planner and the cost model checked on one GPU.

    gpipe-repro gpu-check --device cuda:0          # same as `make gpu-check`; < 10 min on an H100
    gpipe-repro gpu-check --device cpu --tiny      # the same code at toy sizes (what CI runs)

Writes results/gpu/<device name>/ (JSON, markdown, plots) and prints a one-screen summary. An
existing output directory is replaced only after you agree (--overwrite, or the prompt); a non-empty
directory that is not a gpu-check output is refused. Exit status 1 when the engine differs from
plain PyTorch; the overhead, memory and throughput numbers are reported against their targets.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("gpu-check")
    def gpu_check(
            device: str = typer.Option("cuda:0", "--device",
                                       help="cuda:N, or cpu (with --tiny: CI's smoke test)"),
            tiny: bool = typer.Option(False, "--tiny", help="toy sizes: every code path in seconds"),
            out: Optional[Path] = typer.Option(None, "--out", help="output directory (default: "
                                               "results/gpu/<device name>/)"),
            overwrite: bool = typer.Option(False, "--overwrite", help="replace a previous gpu-check output "
                                           "in --out without asking"),
            parts: str = typer.Option("engine,overhead,memory,costs", "--parts",
                                      help="which parts to run, comma-separated"),
    ) -> None:
        """Engine equality, overhead, memory at the paper's sizes and Tables 2/3 from measured costs."""
        from gpipe_repro.repro.gpu_check import (
            GpuCheckSettings,
            OutputRefused,
            check_out_dir,
            default_out_dir,
            run_gpu_check,
            summary,
            write_report,
        )
        from gpipe_repro.repro.gpu_check.settings import PARTS, check_device
        try:
            check_device(device)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--device") from e
        chosen = tuple(p.strip() for p in parts.split(",") if p.strip())
        unknown = sorted(set(chosen) - set(PARTS))
        if unknown or not chosen:
            raise typer.BadParameter(f"unknown part(s) {', '.join(unknown) or '(none given)'}; choose from "
                                     f"{', '.join(PARTS)}", param_hint="--parts")
        if not tiny and check_device(device).type == "cpu":
            raise typer.BadParameter("the paper's sizes need a GPU (hundreds of GiB of work on a CPU): use "
                                     "--device cuda:0, or --tiny for the CPU smoke test",
                                     param_hint="--device")
        target = out if out is not None else default_out_dir(device)
        interactive = sys.stdin.isatty()
        try:
            check_out_dir(target, overwrite=overwrite,
                          confirm=(lambda q: typer.confirm(q, default=False)) if interactive else None)
        except OutputRefused as e:
            raise typer.BadParameter(str(e), param_hint="--out") from e
        settings = (GpuCheckSettings.tiny_preset(device, parts=chosen) if tiny
                    else GpuCheckSettings.full(device, parts=chosen))
        payload = run_gpu_check(settings, progress=lambda msg: typer.echo(msg, err=True))
        files = write_report(payload, target)
        typer.echo(summary(payload, files))
        if "engine" in payload["parts"] and not payload["parts"]["engine"]["ok"]:
            raise typer.Exit(1)
