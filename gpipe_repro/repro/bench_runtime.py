"""`make bench-runtime`: the distributed runtime's speedup, against the ideal and against
torch.distributed.pipelining, on 2 stage processes x 1 thread.

What runs, for every M in {1, 2, 4, 8, 16} and checkpoint "never" (off) and "always" (on), in
alternating rounds of the measurement kernel inside the stage processes
(:func:`gpipe_repro.repro.harness.rounds_in_processes`; the K=1 baselines run on rank 0 while rank 1
waits in a barrier): the K=1 baselines (:class:`~gpipe_repro.repro.harness.PlainK1` on the whole
batch, :class:`~gpipe_repro.repro.harness.SameMicrobatchesK1` on the same M micro-batches); ours,
``GPipe(..., runtime="distributed")`` on balanced cells; torch's ScheduleGPipe on the same cells and
processes; and variants of ours: recompute-ahead (checkpoint on), receives posted at the action
instead of at the step's start (checkpoint off, M >= 4).

Every ratio (speedup = K=1 step time / pipeline step time, ours against torch, a variant against
ours) is the median of per-round paired ratios with its 95% interval; a busy host widens the
intervals. Beside the speedup: the ideal 2M/(M+1) (balanced stages, free communication: exact for
the same-M baseline), and the makespan of the same schedule with each action's cost measured at that
micro-batch size in one process (``run_dataflow``; labelled simulated). Idle time (bubble + load
imbalance) comes from timelines recorded after the rounds. Results: results/runtime/.
"""
from __future__ import annotations

import os
import statistics
from collections import defaultdict
from dataclasses import replace
from typing import Any

from gpipe_repro.report.measurement import Comparison, Figure, Measurement, StopRule
from gpipe_repro.repro.harness import (
    Ours,
    PlainK1,
    SameMicrobatchesK1,
    TorchSchedule,
    batch,
    check_publish,
    publish,
    rounds_in_processes,
    scaled,
    stop_rule,
    verdict_lines,
)

MS = (1, 2, 4, 8, 16)
MODES = {"off": "never", "on": "always"}
PREPOST_MS = (4, 8, 16)
TARGET = 0.90           # of the ideal, at M=8 checkpoint off

COMMAND = "bench-runtime"


def group_items(cfg: dict[str, Any], rank: int, m: int, on: str) -> dict[str, Any]:
    """What one (M, checkpoint) group measures; None: not on this rank."""
    w, blocks, mode = cfg["width"], cfg["blocks"], MODES[on]
    items: dict[str, Any] = {
        "k1_full": PlainK1(w, blocks, mode) if rank == 0 else None,
        "k1_same_m": SameMicrobatchesK1(w, blocks, m, mode, record=True) if rank == 0 else None,
        "ours": Ours(w, blocks, m, mode), "torch": TorchSchedule(w, blocks, rank, m, checkpoint=mode)}
    if on == "on":
        items["ours_ahead"] = Ours(w, blocks, m, mode, ahead=True)
    elif m in PREPOST_MS:
        items["ours_no_prepost"] = Ours(w, blocks, m, mode, prepost=False)
    return items


def comparisons(names: list[str]) -> list[Comparison]:
    out = [Comparison("speedup", "k1_full", "ours"), Comparison("same-M speedup", "k1_same_m", "ours"),
           Comparison("ours/torch throughput", "torch", "ours", target=1.0)]
    if "ours_ahead" in names:
        out.append(Comparison("recompute-ahead step / plain step", "ours_ahead", "ours"))
    if "ours_no_prepost" in names:
        out.append(Comparison("posted at the action / at the step's start", "ours_no_prepost", "ours"))
    return out


def bench_processes(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs in each of the 2 processes: every group's rounds, then timelines of ours."""
    from gpipe_repro.distributed.process_group import init_distributed

    rank = init_distributed().rank
    x, y = batch(cfg["width"], cfg["batch"])
    rule = StopRule(**cfg["rule"])
    out: dict[str, Any] = {"measurements": {}, "timelines": defaultdict(list), "costs": {}}
    for on in MODES:
        for m in MS:
            group = f"{on}/{m}"
            items = group_items(cfg, rank, m, on)
            out["measurements"][group] = rounds_in_processes(
                items, comparisons(list(items)), rule, x, y, warmup=cfg["warmup"],
                label=f"bench-runtime {group}")
            if rank == 0:
                out["costs"][group] = {k: statistics.median(v) for k, v in items["k1_same_m"].costs.items()}
            for name, item in items.items():
                if isinstance(item, Ours):
                    item.pipe.record_timeline = True
                    for _ in range(cfg["record_steps"]):
                        item.step(x, y)
                        out["timelines"][f"{name}/{group}"].append(item.pipe.last_timeline)
            del items
    out["timelines"] = dict(out["timelines"]) if rank == 0 else None
    return out


def ideal_makespan(costs: dict[str, float], m: int, mode: str) -> float:
    """The schedule's makespan with the measured compute costs and free communication."""
    from gpipe_repro.engine.interpreter import run_dataflow
    from gpipe_repro.engine.schedule import COMPUTE, gpipe_schedule

    events = run_dataflow(gpipe_schedule(2, m, mode), lambda a: costs[f"{a.kind.value}/{a.stage}"]
                          if a.kind in COMPUTE else 0.0)
    return max(e.end for e in events)


def idle_seconds(timeline: Any) -> float:
    shares = timeline.breakdown()
    return (shares["bubble"] + shares["load imbalance"]) * timeline.makespan * timeline.num_stages


def group_figures(result: Measurement, m: int, on: str, makespan: float) -> dict[str, Figure]:
    """The group's comparisons, and the speedups over their ideals (targets at M=8, off)."""
    ideal, keyed = 2 * m / (m + 1), on == "off" and m == 8
    target = TARGET if keyed else None
    f = dict(result.figures)
    f["speedup / 2M/(M+1)"] = scaled(f["speedup"], "speedup / 2M/(M+1)", 1 / ideal, target=target)
    f["same-M speedup / 2M/(M+1)"] = scaled(f["same-M speedup"], "same-M speedup / 2M/(M+1)",
                                            1 / ideal, target=target)
    ours = result.times["ours"]
    f["speedup / ideal from costs"] = Figure.of("speedup / ideal from costs",
                                                [makespan / t for t in ours.samples], target=target,
                                                host_fast=ours.host_fast)
    return f


def main(*, width: int = 768, blocks: int = 8, batch: int = 2048, warmup: int = 1, threads: int = 1,
         write: bool = True, budget: float = 1200.0, tolerance: float = 0.02, min_rounds: int = 5,
         max_rounds: int = 40) -> None:
    """Measure, print and (unless `write` is False) record under results/runtime/."""
    check_publish("runtime", "bench_runtime", COMMAND, write=write,
                  extra=("gantt_k2_m8_never.png", "gantt_k2_m8_always.png", "gantt_k2_m8_always_ahead.png"))
    if blocks % 2:
        raise ValueError("--blocks must be even so the two cells are balanced")
    config = {"width": width, "blocks": blocks, "batch": batch, "warmup": warmup, "threads": threads, "write":
              write, "budget": budget, "tolerance": tolerance, "min_rounds": min_rounds, "max_rounds":
              max_rounds}
    from gpipe_repro.distributed import launch_local
    from gpipe_repro.report.gantt import render_gantt
    from gpipe_repro.report.records import markdown_table, results_dir

    rule = stop_rule(budget, tolerance, min_rounds, max_rounds, groups=len(MODES) * len(MS))
    cfg = {**config, "record_steps": 3, "rule": vars(rule)}
    per_rank = launch_local(bench_processes, 2, cfg, timeout=300, threads=threads)
    measurements = {g: Measurement.from_json(r) for g, r in per_rank[0]["measurements"].items()}
    timelines, costs = per_rank[0]["timelines"], per_rank[0]["costs"]
    rows, ahead_rows, prepost_rows, records, checks = [], [], [], {}, []
    for on, mode in MODES.items():
        for m in MS:
            group = f"{on}/{m}"
            result = measurements[group]
            makespan = ideal_makespan(costs[group], m, mode)
            f = group_figures(result, m, on, makespan)
            recorded = timelines[f"ours/{group}"]
            records[group] = {"measurement": result.to_json(),
                              "figures": {k: v.to_json() for k, v in f.items()},
                              "action_costs_s": costs[group], "ideal_makespan_s_simulated": makespan,
                              "breakdown_last_recorded_step": recorded[-1].breakdown()}
            t = result.times
            rows.append([mode, m, batch // m, t["k1_full"].cell(), t["ours"].cell(), f["speedup"].cell(),
                         2 * m / (m + 1), f["speedup / 2M/(M+1)"].cell(), t["k1_full"].value / makespan,
                         f["speedup / ideal from costs"].cell(), f["same-M speedup / 2M/(M+1)"].cell(),
                         f["ours/torch throughput"].cell()])
            checks.append(replace(f["ours/torch throughput"], name=f"ours/torch, checkpoint {mode}, M={m}"))
            if on == "off" and m == 8:
                checks[:0] = [replace(f[k], name=f"K=2 M=8 off: {k}") for k in (
                    "speedup / 2M/(M+1)", "speedup / ideal from costs", "same-M speedup / 2M/(M+1)")]
            if "recompute-ahead step / plain step" in f:
                idle = [statistics.median(idle_seconds(x) for x in timelines[f"{v}/{group}"])
                        for v in ("ours", "ours_ahead")]
                ahead_rows.append([m, f["recompute-ahead step / plain step"].cell(), *idle,
                                   1 - idle[1] / idle[0]])
            if "posted at the action / at the step's start" in f:
                prepost_rows.append([m, f["posted at the action / at the step's start"].cell()])
    out = results_dir("runtime") if write else None
    gantts = {}
    if out is not None:
        for key, name, label in (("ours/off/8", "gantt_k2_m8_never.png", "checkpoint never"),
                                 ("ours/on/8", "gantt_k2_m8_always.png", "checkpoint always"),
                                 ("ours_ahead/on/8", "gantt_k2_m8_always_ahead.png",
                                  "checkpoint always, recompute-ahead")):
            gantts[key] = str(render_gantt(timelines[key][-1], out / name,
                                           title=f"measured: 2 stage processes, M=8, {label}"))
    rounds = sorted(r.rounds for r in measurements.values())
    text = (f"# Distributed runtime benchmark (measured)\n\nMLP of {blocks} x (Linear({width}, "
            f"{width}) + ReLU), balanced 2 cells, batch {batch}, 2 stage processes x "
            f"{threads} thread (gloo, CPU) vs ONE process (K=1). {rounds[0]}-{rounds[-1]} alternating "
            "rounds per group; each figure is the median of per-round paired ratios with its 95% "
            "interval (a busy host widens it; fewer than 6 rounds: the range, with its coverage).\n\n"
            "## Speedup over K=1 and throughput against torch.distributed.pipelining\n\n"
            + markdown_table(["checkpoint", "M", "rows/mb", "K=1 ms", "ours ms", "speedup",
                              "ideal 2M/(M+1)", "speedup/ideal", "ideal from costs*",
                              "makespan from costs / ours**", "same-M speedup/ideal", "ours/torch"], rows)
            + "\n\n* simulated from measured costs: K=1 time / the makespan of the same schedule with "
            "every action's cost measured alone at that micro-batch size, communication free.\n"
            "** that makespan over our step, per round (the K=1 time cancels): not the speedup "
            "column over the ideal one, which divide medians.\n\n"
            "## Recompute-ahead (checkpoint always): idle = bubble + load imbalance, from timelines\n\n"
            + markdown_table(["M", "step ratio, ahead / plain", "idle s", "idle s, ahead",
                              "idle reduction"], ahead_rows)
            + "\n\n## Receives posted at the RECV action vs at the step's start (gloo default)\n\n"
            + markdown_table(["M", "step ratio"], prepost_rows)
            + "\n\n## Checks (M=8 checkpoint off; ours/torch on every row, in table order)\n\n"
            + verdict_lines(checks) + "\n\nGantt charts (measured, M=8): "
            + ", ".join(os.path.basename(p) for p in gantts.values()) + "\n")
    publish("runtime", "bench_runtime", {
        "experiment": "distributed runtime vs K=1 and torch.distributed.pipelining", "config": cfg,
        "groups": records, "timeline_k2_m8_always_ahead": timelines["ours_ahead/on/8"][-1].to_json(),
        "gantt_png": gantts}, text, command=COMMAND, write=write)
