"""`make bench-schedules`: every schedule of ours against every torch.distributed.pipelining schedule
that applies, on the same cells, data and processes (K=2 stage processes x 1 thread, gloo).

What runs, for every (batch, M), in alternating rounds of the measurement kernel inside the stage
processes (:func:`gpipe_repro.repro.harness.rounds_in_processes`):

- K=1: plain PyTorch, the whole model on the whole batch, one process (rank 0 alone) -> "speedup";
- K=1 on the same M micro-batches (rank 0 alone): its step time / 2 is the ideal 2-process step for
  that M (the same work split evenly, no bubble, free communication) -> "of ideal";
- ours: ``GPipe(..., runtime="distributed", schedule=S)`` for every S in
  :data:`gpipe_repro.engine.schedule.SCHEDULES` (gpipe, 1f1b, zb-h1, and interleaved, zb-v and
  dualpipe-v with the model cut in 4 cells, two per process, like torch's looped and V schedules),
  checkpoint "never";
- torch's: every schedule of :data:`~gpipe_repro.repro.harness.TORCH_SINGLE`, ``TORCH_LOOPED`` and
  ``TORCH_V`` (:class:`~gpipe_repro.repro.harness.TorchSchedule`). A schedule either side refuses
  for a configuration is listed as not applicable, with the reason.

Every figure is the median of per-round paired ratios with its 95% interval (a busy host widens
it). Ours-best against torch-best: the two schedules fastest by median, compared round by round.
Peak memory is not measured on CPU (no allocator statistics): the comparison is made without the
memory condition, and the output says so. Results: results/schedules/ (JSON, markdown).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from gpipe_repro.report.measurement import Comparison, Figure, Measurement, StopRule
from gpipe_repro.repro.harness import (
    TORCH_LOOPED,
    TORCH_SINGLE,
    TORCH_V,
    Ours,
    PlainK1,
    SameMicrobatchesK1,
    TorchSchedule,
    batch,
    check_publish,
    publish,
    rounds_in_processes,
    stop_rule,
    verdict_lines,
)

TARGETS = {"median ours-best / torch-best": 1.10, "min ours-best / torch-best": 1.0, "M=4 of ideal": 0.95}

COMMAND = "bench-schedules"


def group_items(cfg: dict[str, Any], rank: int, m: int) -> tuple[dict[str, Any], dict[str, str]]:
    """What one (batch, M) group measures; and the schedules not applicable, with the reason."""
    from gpipe_repro.engine.schedule import SCHEDULES

    w, blocks = cfg["width"], cfg["blocks"]
    items: dict[str, Any] = {"k1_full": PlainK1(w, blocks) if rank == 0 else None,
                             "k1_same_m": SameMicrobatchesK1(w, blocks, m) if rank == 0 else None}
    refused = {}
    for name in SCHEDULES:
        try:
            items[f"ours:{name}"] = Ours(w, blocks, m, schedule=name)
        except ValueError as e:   # the engine's verdict on this configuration (the same on every rank)
            refused[f"ours:{name}"] = str(e).splitlines()[0][:200]
    for name in TORCH_SINGLE + TORCH_LOOPED + TORCH_V:
        try:
            items[f"torch:{name}"] = TorchSchedule(w, blocks, rank, m, name)
        except Exception as e:   # torch's own verdict on this configuration (the same on every rank)
            refused[f"torch:{name}"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return items, refused


def bench_processes(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs in each of the 2 processes: every group's rounds (rank 0 returns the measurements)."""
    from gpipe_repro.distributed.process_group import init_distributed

    rank = init_distributed().rank
    rule = StopRule(**cfg["rule"])
    measurements, refused_all = {}, {}
    for rows in cfg["batches"]:
        x, y = batch(cfg["width"], rows)
        for m in cfg["ms"]:
            group = f"{rows}/{m}"
            items, refused_all[group] = group_items(cfg, rank, m)
            pipes = [n for n in items if n.startswith(("ours:", "torch:"))]
            comps = [Comparison(f"speedup {n}", "k1_full", n) for n in pipes]
            measurements[group] = rounds_in_processes(items, comps, rule, x, y, warmup=cfg["warmup"],
                                                      label=f"bench-schedules {group}")
            del items
    return {"measurements": measurements, "refused": refused_all}


def best_against_best(result: Measurement, tolerance: float) -> tuple[str, str, Figure]:
    """Ours-best and torch-best (by median time) and their paired ratio, torch time / ours time."""
    ours = min((n for n in result.times if n.startswith("ours:")), key=lambda n: result.times[n].value)
    theirs = min((n for n in result.times if n.startswith("torch:")), key=lambda n: result.times[n].value)
    ratios = [t / o for t, o in zip(result.times[theirs].samples, result.times[ours].samples)]
    return ours, theirs, Figure.of(f"{ours} / {theirs}", ratios, tolerance=tolerance,
                                   host_fast=result.host_fast)


def main(*, width: int = 1024, blocks: int = 8, batches: Sequence[int] = (256, 1024),
         ms: Sequence[int] = (2, 4, 8), warmup: int = 1, threads: int = 1, smoke: bool = False,
         budget: float = 1200.0, tolerance: float = 0.02, min_rounds: int = 5,
         max_rounds: int = 40) -> None:
    """Measure, print and (unless a smoke run) record under results/schedules/."""
    if blocks % 4:
        raise ValueError("--blocks must be a multiple of 4 (2 cells for ours, 4 chunks for torch's looped "
                         "and V schedules)")
    if smoke:
        width, batches, budget, min_rounds, max_rounds = 128, [64], 30.0, 3, 3
    check_publish("schedules", "bench_schedules", COMMAND, write=not smoke)
    config = {"width": width, "blocks": blocks, "batches": batches, "ms": ms, "warmup": warmup, "threads":
              threads, "smoke": smoke, "budget": budget, "tolerance": tolerance, "min_rounds": min_rounds,
              "max_rounds": max_rounds}
    from gpipe_repro.distributed import launch_local
    from gpipe_repro.report.records import markdown_table

    rule = stop_rule(budget, tolerance, min_rounds, max_rounds, groups=len(batches) * len(ms))
    cfg = {**config, "rule": vars(rule)}
    per_rank = launch_local(bench_processes, 2, cfg, timeout=300, threads=threads)
    rows, records, ratios, of_ideal_m4 = [], [], [], []
    for group, data in per_rank[0]["measurements"].items():
        rows_n, m = (int(v) for v in group.split("/"))
        result = Measurement.from_json(data)
        ideal = [t / 2 for t in result.times["k1_same_m"].samples]
        of_ideal = {n: Figure.of(f"{n} of ideal", [i / t for i, t in zip(ideal, f.samples)],
                                 host_fast=result.host_fast)
                    for n, f in result.times.items() if n.startswith(("ours:", "torch:"))}
        ours, theirs, ratio = best_against_best(result, tolerance)
        ratios.append(ratio)
        if m == 4:
            best = max((n for n in of_ideal if n.startswith("ours:")), key=lambda n: of_ideal[n].value)
            of_ideal_m4.append(of_ideal[best])
        for n in sorted(of_ideal, key=lambda n: result.times[n].value):
            rows.append([rows_n, m, n, result.times[n].cell(), result.figures[f"speedup {n}"].cell(),
                         of_ideal[n].cell(), "n/a"])
        records.append({"batch": rows_n, "micro_batches": m, "measurement": data,
                        "of_ideal": {n: f.to_json() for n, f in of_ideal.items()}, "ours_best": ours,
                        "torch_best": theirs, "ours_best_over_torch_best": ratio.to_json(),
                        "not_applicable": per_rank[0]["refused"].get(group, {})})
    pooled = [s for f in ratios for s in f.samples]
    fast = [(f.host_fast, f.rounds) for f in ratios if f.host_fast is not None]
    checks = [Figure.of("every (batch, M)'s rounds pooled: ours-best / torch-best", pooled,
                        target=TARGETS["median ours-best / torch-best"],
                        host_fast=sum(h * n for h, n in fast) / sum(n for _, n in fast) if fast else None)]
    checks += [dataclasses.replace(f, name=f"ours-best / torch-best, batch {r['batch']}, "
                                           f"M={r['micro_batches']}",
                                   target=TARGETS["min ours-best / torch-best"], direction=">=")
               for r, f in zip(records, ratios)]
    checks += [dataclasses.replace(f, name=f"M=4: best of ours, of the ideal ({f.name})",
                                   target=TARGETS["M=4 of ideal"], direction=">=")
               for f in of_ideal_m4]
    refused = sorted({f"{n}: {why}" for r in records for n, why in r["not_applicable"].items()})
    text = "\n\n".join([
        "# Schedules, K=2 stage processes (measured" + (", SMOKE RUN: not of record)" if smoke else ")"),
        "Each figure: the median over alternating rounds with its 95% interval (a busy host "
        "widens it). Peak memory per stage: n/a on CPU (no allocator statistics); the best-vs-best "
        "comparison is made without the equal-or-lower-memory condition.",
        markdown_table(["batch", "M", "schedule", "step", "speedup vs K=1", "of ideal",
                        "peak memory/stage"], rows),
        "Checks:\n" + verdict_lines(checks),
        "Not applicable:\n" + ("\n".join(f"- {x}" for x in refused) or "- none")])
    publish("schedules", "bench_schedules", {
        "experiment": "schedules: ours vs torch.distributed.pipelining, K=2", "config": cfg,
        "rows": records, "checks": [f.to_json() for f in checks]}, text, command=COMMAND, write=not smoke)
