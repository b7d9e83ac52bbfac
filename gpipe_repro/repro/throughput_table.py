"""`make throughput-table`: the GPipe paper's Tables 2 and 3 (normalized throughput over K x M).

AmoebaNet-D and Transformer-48, K in {2, 4, 8}, M in {1, 4, 32}, normalized to K=2, M=1, plus the
Table 3 setting (AmoebaNet-D (18, 128), Transformer-24, M=32, PCIe links). Costs are calibrated on
this device at the micro-batch size each configuration uses, partitions come from the exact
partitioner, every cell is simulated, and measured on real stage processes where K <= usable
cores. The library logic is :mod:`gpipe_repro.repro.throughput`; this file only declares the defaults.

    python -m experiments.throughput_table                 # scaled-down, < 10 min on 2 CPU cores
    python -m experiments.throughput_table --paper-size --device cuda    # the paper's exact models

Writes results/throughput/{throughput_table.json, throughput_table.md, speedup.png, bubble.png,
gantt.png} (results/ is $GPIPE_REPRO_RESULTS when set), or --out DIR. An earlier table there is
replaced only with --overwrite; a file the command did not write is never replaced; the results of
record (the checkout's results/) are replaced only by `make throughput-table`, whose entry point
(experiments/throughput_table.py) passes ``record=True``.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from gpipe_repro.engine.partition import OBJECTIVES
from gpipe_repro.report.records import OutputRefused, results_root
from gpipe_repro.repro.throughput import PAPER_MICROBATCH, POLICIES, SweepSettings, run_with_progress
from gpipe_repro.repro.throughput.outputs import check_out_dir, check_overwrite
from gpipe_repro.sim.links import LINK_NAMES

DEFAULTS = SweepSettings(ks=(2, 4, 8), ms=(1, 4, 32), policy="micro", checkpoint="always",
                         recompute_ahead=False, schedule="gpipe", objective="bottleneck",
                         link="gloo-loopback", device="cpu", method="time", threads=1)


def settings_from_args(argv: list[str] | None = None,
                       prog: str | None = None) -> tuple[SweepSettings, str, bool]:
    """(settings, output directory, log to W&B) from the command line."""
    settings, out, wandb, _ = _parse(argv, prog)
    return settings, out, wandb


def _parse(argv: list[str] | None, prog: str | None) -> tuple[SweepSettings, str, bool, bool]:
    ap = argparse.ArgumentParser(prog=prog or "python -m experiments.throughput_table",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--paper-size", action="store_true",
                    help="the paper's exact models (AmoebaNet-D (18, 256), Transformer-48 d 2048): "
                         "use on a GPU host with --device cuda")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=DEFAULTS.device)
    ap.add_argument("--link", choices=LINK_NAMES, default=None,
                    help="link model of the simulation (default: gloo-loopback on cpu, nvlink on cuda)")
    ap.add_argument("--policy", choices=POLICIES, default=DEFAULTS.policy,
                    help="micro: fixed micro-batch, N = M x b (default); mini: fixed mini-batch N")
    ap.add_argument("--minibatch", type=int, default=DEFAULTS.minibatch)
    ap.add_argument("--objective", choices=OBJECTIVES, default=DEFAULTS.objective)
    ap.add_argument("--checkpoint", choices=("always", "except_last", "never"),
                    default=DEFAULTS.checkpoint)
    ap.add_argument("--recompute-ahead", action="store_true")
    ap.add_argument("--method", choices=("time", "flops"), default=DEFAULTS.method)
    ap.add_argument("--no-measure", action="store_true", help="simulate only")
    ap.add_argument("--no-wandb", action="store_true")
    ap.add_argument("--out", default=None,
                    help="output directory (default: results/throughput, under $GPIPE_REPRO_RESULTS "
                         "when set)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier throughput table in --out")
    args = ap.parse_args(argv)
    out = args.out if args.out is not None else str(results_root() / "throughput")
    settings = replace(DEFAULTS, device=args.device, policy=args.policy, minibatch=args.minibatch,
                       objective=args.objective, checkpoint=args.checkpoint,
                       recompute_ahead=args.recompute_ahead, method=args.method,
                       measure=not args.no_measure, paper_size=args.paper_size,
                       link=args.link or ("nvlink" if args.device == "cuda" else "gloo-loopback"))
    if args.paper_size:
        settings = replace(settings, microbatch=tuple(PAPER_MICROBATCH.items()))
    if args.device == "cuda":
        settings = replace(settings, threads=None)
    return settings, out, not args.no_wandb, args.overwrite


def main(argv: list[str] | None = None, prog: str | None = None, *, record: bool = False) -> None:
    """Parse, check the output directory (before any work), sweep, write.

    `record=True` is `make throughput-table` (experiments/throughput_table.py): it replaces its own
    previous table without --overwrite, the results of record included."""
    argv = list(sys.argv[1:] if argv is None else argv)
    settings, out, wandb, overwrite = _parse(argv, prog)
    if settings.paper_size and settings.device == "cpu":
        print("warning: --paper-size on a CPU calibrates and measures the paper's full models; this "
              "takes hours. Use --device cuda on a GPU host.", flush=True)
    try:
        check_out_dir(Path(out), overwrite=overwrite, record=record)
        check_overwrite(out, measuring=settings.measure)
    except (OutputRefused, FileExistsError) as e:
        print(f"{prog or 'python -m experiments.throughput_table'}: error: {e}", file=sys.stderr)
        sys.exit(2)
    run_with_progress(settings, out, log_wandb=wandb,
                      command={"prog": prog or "python -m experiments.throughput_table", "argv": argv})


if __name__ == "__main__":
    main()
