"""`make throughput-table`: the GPipe paper's Tables 2 and 3 (normalized throughput over K x M).

AmoebaNet-D and Transformer-48, K in {2, 4, 8}, M in {1, 4, 32}, normalized to K=2, M=1, plus the
Table 3 setting (AmoebaNet-D (18, 128), Transformer-24, M=32, PCIe links). Costs are calibrated on
this device at the micro-batch size each configuration uses, partitions come from the exact
partitioner, every cell is simulated, and measured on real stage processes where K <= usable
cores. The library logic is :mod:`gpipe_repro.repro.throughput`; this file only declares the defaults.

    gpipe-repro throughput-table                           # scaled-down, < 10 min on 2 CPU cores
    gpipe-repro throughput-table --paper-size --device cuda    # the paper's exact models

Writes results/throughput/{throughput_table.json, throughput_table.md, speedup.png, bubble.png,
gantt.png} (results/ is $GPIPE_REPRO_RESULTS when set), or --out DIR. An earlier table there is
replaced only with --overwrite; a file the command did not write is never replaced; the results of
record (the checkout's results/) are replaced only with --record (what `make throughput-table` gives).
The command line is `gpipe-repro throughput-table` (gpipe_repro/commands/throughput.py).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from gpipe_repro.repro.throughput import PAPER_MICROBATCH, SweepSettings, run_with_progress
from gpipe_repro.repro.throughput.outputs import check_out_dir, check_overwrite

DEFAULTS = SweepSettings(ks=(2, 4, 8), ms=(1, 4, 32), policy="micro", checkpoint="always",
                         recompute_ahead=False, schedule="gpipe", objective="bottleneck",
                         link="gloo-loopback", device="cpu", method="time", threads=1)


def sweep_settings(*, paper_size: bool, device: str, link: str | None, policy: str, minibatch: int,
                   objective: str, checkpoint: str, recompute_ahead: bool, method: str,
                   measure: bool) -> SweepSettings:
    """The sweep's settings: DEFAULTS with the command line's choices (the link and the threads
    follow the device)."""
    settings = replace(DEFAULTS, device=device, policy=policy, minibatch=minibatch, objective=objective,
                       checkpoint=checkpoint, recompute_ahead=recompute_ahead, method=method,
                       measure=measure, paper_size=paper_size,
                       link=link or ("nvlink" if device == "cuda" else "gloo-loopback"))
    if paper_size:
        settings = replace(settings, microbatch=tuple(PAPER_MICROBATCH.items()))
    return replace(settings, threads=None) if device == "cuda" else settings


def main(settings: SweepSettings, out: Path, *, overwrite: bool = False, record: bool = False,
         wandb: bool = True, command: dict[str, object] | None = None) -> None:
    """Check the output directory (before any work), sweep, write.

    Raises:
        OutputRefused, FileExistsError: `out` holds what this run may not replace (`overwrite`:
            this command's earlier table; `record`: the results of record).
    """
    if settings.paper_size and settings.device == "cpu":
        print("warning: --paper-size on a CPU calibrates and measures the paper's full models; this "
              "takes hours. Use --device cuda on a GPU host.", flush=True)
    check_out_dir(out, overwrite=overwrite, record=record)
    check_overwrite(str(out), measuring=settings.measure)
    run_with_progress(settings, str(out), log_wandb=wandb, command=command)
