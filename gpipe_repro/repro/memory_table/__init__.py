"""`make memory-table`: the GPipe paper's Table 1 (maximum model size), reproduced by the planner.

Transformer-L (16 GiB per device) and AmoebaNet-D (L, D) (8 GiB) for Naive-1 and Pipeline-K, the
peak activation per device against M and K, and the planner checked against real steps on this CPU.
The package: :mod:`~gpipe_repro.repro.memory_table.experiment` (the experiment),
:mod:`~gpipe_repro.repro.memory_table.table1` (its domain rows), :mod:`~gpipe_repro.repro.memory_table.report`
(its report); this file only declares the settings.

    python -m experiments.memory_table                  # < 10 min on 2 CPU cores
    python -m experiments.memory_table --micro-batches 32 --no-amoebanet

Writes results/memory/{memory_table.json, memory_table.md, max_params.png,
activation_vs_microbatches.png} (results/ is $GPIPE_REPRO_RESULTS when set), or --out DIR. An earlier
table there is replaced only with --overwrite; a file the command did not write is never replaced;
the results of record (the checkout's results/) are replaced only by `make memory-table`, whose entry
point (experiments/memory_table.py) passes ``record=True``.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from gpipe_repro.report.records import OutputRefused, results_root
from gpipe_repro.repro.memory_table.experiment import Settings, check_out_dir, run, write
from gpipe_repro.repro.memory_table.table1 import Table1Settings

DEFAULTS = Settings(
    table1=Table1Settings(micro_batches=8, transformer_ks=(1, 8, 32, 128), amoebanet_ks=(1, 2, 4, 8),
                          attention_variants=("fused", "math")),
    scaling_L=24, scaling_ks=(1, 2, 4, 8), scaling_ms=(1, 2, 4, 8, 16, 32),
    validation_ks=(1, 2, 4), validation_checkpoints=("except_last", "never"),
    validation_micro_batches=4)


def main(argv: list[str] | None = None, *, record: bool = False) -> None:
    """Parse, check the output directory (before any work), run, write.

    `record=True` is `make memory-table` (experiments/memory_table.py): it replaces its own previous
    table without --overwrite, the results of record included."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, default=DEFAULTS.table1.micro_batches,
                    help="M of every pipeline row (the paper does not state it)")
    ap.add_argument("--no-amoebanet", action="store_true", help="skip the AmoebaNet rows (slowest)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: results/memory, under $GPIPE_REPRO_RESULTS when set)")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier table in --out")
    ap.add_argument("--no-wandb", action="store_true", help="do not log to W&B (local files only)")
    args = ap.parse_args(argv)
    if args.micro_batches < 1:
        ap.error(f"--micro-batches must be >= 1, got {args.micro_batches}")
    out = args.out if args.out is not None else results_root() / "memory"
    try:
        check_out_dir(out, overwrite=args.overwrite, record=record)
    except OutputRefused as e:
        ap.error(str(e))
    settings = replace(DEFAULTS, table1=replace(DEFAULTS.table1, micro_batches=args.micro_batches),
                       amoebanet=not args.no_amoebanet)
    paths = write(run(settings), out, wandb=not args.no_wandb)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
