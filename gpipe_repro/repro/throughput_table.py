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
Where the new calibration cannot tell a cut of the table it replaces from its best, it keeps that
cut (or those of --cuts-from FILE; --fresh-cuts: every cut afresh), so reruns agree on their cuts.
The command line is `gpipe-repro throughput-table` (gpipe_repro/commands/throughput.py).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from gpipe_repro.report.records import read_json
from gpipe_repro.repro.throughput import PAPER_MICROBATCH, SweepSettings, run_with_progress
from gpipe_repro.repro.throughput.outputs import MANIFEST, check_out_dir, check_overwrite, is_table, owns

DEFAULTS = SweepSettings(ks=(2, 4, 8), ms=(1, 4, 32), policy="micro", checkpoint="always",
                         recompute_ahead=False, schedule="gpipe", objective="bottleneck",
                         link="gloo-loopback", device="cpu", method="time", threads=1)


def sweep_settings(*, paper_size: bool, device: str, link: str | None, policy: str, minibatch: int,
                   objective: str, checkpoint: str, recompute_ahead: bool, method: str,
                   measure: bool, time_limit_s: float | None = None) -> SweepSettings:
    """The sweep's settings: DEFAULTS with the command line's choices (the link and the threads
    follow the device)."""
    settings = replace(DEFAULTS, device=device, policy=policy, minibatch=minibatch, objective=objective,
                       checkpoint=checkpoint, recompute_ahead=recompute_ahead, method=method,
                       measure=measure, paper_size=paper_size, time_limit_s=time_limit_s,
                       link=link or ("nvlink" if device == "cuda" else "gloo-loopback"))
    if paper_size:
        settings = replace(settings, microbatch=tuple(PAPER_MICROBATCH.items()))
    return replace(settings, threads=None) if device == "cuda" else settings


def main(settings: SweepSettings, out: Path, *, overwrite: bool = False, record: bool = False,
         wandb: bool = True, command: dict[str, object] | None = None,
         cuts_from: Path | None = None, fresh_cuts: bool = False) -> None:
    """Check the output directory and the earlier table to keep cuts from (before any work), sweep,
    write.

    The cuts: by default those of the table this run replaces in `out` (for `make throughput-table`,
    the results of record), or of `cuts_from`, are kept where the new calibration cannot tell them
    from its best (:mod:`gpipe_repro.repro.throughput.kept_cuts`); `fresh_cuts` chooses every cut
    from the new costs alone.

    Raises:
        OutputRefused, FileExistsError: `out` holds what this run may not replace (`overwrite`:
            this command's earlier table; `record`: the results of record).
        CutsSourceError: `cuts_from` is not a throughput table's JSON, or is given with `fresh_cuts`.
    """
    if settings.paper_size and settings.device == "cpu":
        print("warning: --paper-size on a CPU calibrates and measures the paper's full models; this "
              "takes hours. Use --device cuda on a GPU host.", flush=True)
    check_out_dir(out, overwrite=overwrite, record=record)
    check_overwrite(str(out), measuring=settings.measure)
    run_with_progress(settings, str(out), log_wandb=wandb, command=command,
                      cuts_from=earlier_table(out, cuts_from, fresh_cuts))


class CutsSourceError(ValueError):
    """--cuts-from names no earlier throughput table (or contradicts --fresh-cuts)."""


def earlier_table(out: Path, cuts_from: Path | None, fresh_cuts: bool) -> Path | None:
    """The throughput_table.json whose cuts a run keeps: `cuts_from` (checked now, before any work),
    else the one this command wrote in `out` if there is one; None with `fresh_cuts`."""
    if fresh_cuts:
        if cuts_from is not None:
            raise CutsSourceError("--cuts-from and --fresh-cuts contradict each other: give one")
        return None
    if cuts_from is None:
        return out / MANIFEST if owns(out) else None
    try:
        data = read_json(cuts_from)
    except (OSError, ValueError) as e:
        raise CutsSourceError(f"--cuts-from {cuts_from}: cannot read a throughput table there ({e}); "
                              "give the throughput_table.json of an earlier `gpipe-repro "
                              "throughput-table` run, or --fresh-cuts") from None
    if not isinstance(data, dict) or not is_table(data):
        raise CutsSourceError(f"--cuts-from {cuts_from} is not a throughput table (it has no table2, "
                              "table3 and settings): give the throughput_table.json of an earlier "
                              "`gpipe-repro throughput-table` run, or --fresh-cuts")
    return cuts_from
