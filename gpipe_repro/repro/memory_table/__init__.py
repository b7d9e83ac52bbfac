"""`make memory-table`: the GPipe paper's Table 1 (maximum model size), reproduced by the planner.

Transformer-L (16 GiB per device) and AmoebaNet-D (L, D) (8 GiB) for Naive-1 and Pipeline-K, the
peak activation per device against M and K, and the planner checked against real steps on this CPU.
The package: :mod:`~gpipe_repro.repro.memory_table.experiment` (the experiment),
:mod:`~gpipe_repro.repro.memory_table.table1` (its domain rows), :mod:`~gpipe_repro.repro.memory_table.report`
(its report); this file only declares the settings.

    gpipe-repro memory-table --record                   # `make memory-table`: < 10 min on 2 CPU cores
    gpipe-repro memory-table --m 32 --no-amoebanet --out /tmp/memory

Writes results/memory/{memory_table.json, memory_table.md, max_params.png,
activation_vs_microbatches.png} (results/ is $GPIPE_REPRO_RESULTS when set), or --out DIR. An earlier
table there is replaced only with --overwrite; a file the command did not write is never replaced;
the results of record (the checkout's results/) are replaced only with --record (what `make
memory-table` gives). The command line is `gpipe-repro memory-table` (gpipe_repro/commands/memory.py).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from gpipe_repro.report.records import results_root
from gpipe_repro.repro.memory_table.experiment import Settings, check_out_dir, run, write
from gpipe_repro.repro.memory_table.table1 import Table1Settings

DEFAULTS = Settings(
    table1=Table1Settings(micro_batches=8, transformer_ks=(1, 8, 32, 128), amoebanet_ks=(1, 2, 4, 8),
                          attention_variants=("fused", "math")),
    scaling_L=24, scaling_ks=(1, 2, 4, 8), scaling_ms=(1, 2, 4, 8, 16, 32),
    validation_ks=(1, 2, 4), validation_checkpoints=("except_last", "never"),
    validation_micro_batches=4)


def main(*, micro_batches: int = DEFAULTS.table1.micro_batches, amoebanet: bool = True,
         out: Path | None = None, overwrite: bool = False, record: bool = False, wandb: bool = True) -> None:
    """Check the output directory (before any work), run, write.

    `out` defaults to results/memory (under $GPIPE_REPRO_RESULTS when set); `record` lets the run
    replace the results of record (what `make memory-table` gives).

    Raises:
        OutputRefused: `out` holds what this run may not replace.
    """
    out = out if out is not None else results_root() / "memory"
    check_out_dir(out, overwrite=overwrite, record=record)
    settings = replace(DEFAULTS, table1=replace(DEFAULTS.table1, micro_batches=micro_batches),
                       amoebanet=amoebanet)
    paths = write(run(settings), out, wandb=wandb)
    for name, path in paths.items():
        print(f"{name}: {path}")
