"""`make throughput-table`: the GPipe paper's Tables 2 and 3 (normalized throughput over K x M).

AmoebaNet-D and Transformer-48, K in {2, 4, 8}, M in {1, 4, 32}, normalized to K=2, M=1, plus the
Table 3 setting (AmoebaNet-D (18, 128), Transformer-24, M=32, PCIe links). Costs are calibrated on
this device at the micro-batch size each configuration uses, partitions come from the exact
partitioner, every cell is simulated, and measured on real stage processes where K <= usable
cores. The library logic is :mod:`gpipe_repro.repro.throughput`; this file only declares the defaults.

    python -m experiments.throughput_table                 # scaled-down, < 10 min on 2 CPU cores
    python -m experiments.throughput_table --paper-size --device cuda    # the paper's exact models

Writes results/throughput/{throughput_table.json, throughput_table.md, speedup.png, bubble.png,
gantt.png}.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from gpipe_repro.engine.partition import OBJECTIVES
from gpipe_repro.repro.throughput import PAPER_MICROBATCH, POLICIES, SweepSettings, run_with_progress
from gpipe_repro.repro.throughput.outputs import check_overwrite
from gpipe_repro.sim.links import LINK_NAMES

DEFAULTS = SweepSettings(ks=(2, 4, 8), ms=(1, 4, 32), policy="micro", checkpoint="always",
                         recompute_ahead=False, schedule="gpipe", objective="bottleneck",
                         link="gloo-loopback", device="cpu", method="time", threads=1,
                         wait_idle=10.0)


def settings_from_args(argv: list[str] | None = None,
                       prog: str | None = None) -> tuple[SweepSettings, str, bool]:
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
    ap.add_argument("--wait-idle", type=float, default=DEFAULTS.wait_idle,
                    help="seconds to wait for an idle host before each measured run")
    ap.add_argument("--no-wandb", action="store_true")
    ap.add_argument("--out", default="results/throughput")
    args = ap.parse_args(argv)
    settings = replace(DEFAULTS, device=args.device, policy=args.policy, minibatch=args.minibatch,
                       objective=args.objective, checkpoint=args.checkpoint,
                       recompute_ahead=args.recompute_ahead, method=args.method,
                       measure=not args.no_measure, paper_size=args.paper_size,
                       wait_idle=args.wait_idle,
                       link=args.link or ("nvlink" if args.device == "cuda" else "gloo-loopback"))
    if args.paper_size:
        settings = replace(settings, microbatch=tuple(PAPER_MICROBATCH.items()))
    if args.device == "cuda":
        settings = replace(settings, threads=None)
    return settings, args.out, not args.no_wandb


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    settings, out, wandb = settings_from_args(argv, prog)
    if settings.paper_size and settings.device == "cpu":
        print("warning: --paper-size on a CPU calibrates and measures the paper's full models; this "
              "takes hours. Use --device cuda on a GPU host.", flush=True)
    try:
        check_overwrite(out, measuring=settings.measure)
    except FileExistsError as e:
        sys.exit(f"error: {e}")
    run_with_progress(settings, out, log_wandb=wandb,
                      command={"prog": prog or "python -m experiments.throughput_table", "argv": argv})


if __name__ == "__main__":
    main()
