"""Measured cells: real stage processes of the distributed runtime where K fits the host."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpipe_repro.distributed.measure import measure_pipeline
from gpipe_repro.models.workload import Workload
from gpipe_repro.report.host import usable_cores
from gpipe_repro.report.measurement import Comparison, StopRule
from gpipe_repro.report.measurement import measure as measure_rounds
from gpipe_repro.repro.throughput.rows import Row
from gpipe_repro.repro.throughput.settings import SweepSettings

MeasureFn = Callable[[Workload, list[int], int, int, str], dict[str, Any]]
"""(workload, balance, M, batch, checkpoint) -> {"step_time_s", "step_times", "timeline"}."""

CELL_RULE = StopRule(min_rounds=5, max_rounds=10, budget_s=270.0, tolerance=0.03)
"""The rounds of a table's measured cells (each round launches every cell's stage processes). On
this project's host 10 rounds take about 250 s per model; the budget bounds a slow hour's rounds,
in which `make throughput-table` took 906 s of the 860 its part of `make results` has."""



#: Seconds a table keeps, after its measured rounds, for the schedule ablation, pages and charts.
AFTER_MEASURING_S = 160.0


def round_budget(rule: StopRule, time_limit_s: float | None, elapsed_s: float, models_left: int) -> StopRule:
    """`rule` with its time budget cut to this model's share of what a table limited to
    `time_limit_s` seconds has left after `elapsed_s` (less :data:`AFTER_MEASURING_S`), shared by the
    `models_left` models still to measure; at least 30 s (the rounds' intervals need a few)."""
    if time_limit_s is None:
        return rule
    share = (time_limit_s - elapsed_s - AFTER_MEASURING_S) / max(1, models_left)
    return replace(rule, budget_s=max(30.0, min(rule.budget_s, share)))


def measurable_k(settings: SweepSettings) -> int:
    """The largest K that real stage processes can run here: one core per stage on a CPU host, one
    GPU per stage on a GPU host."""
    if settings.device == "cuda":
        import torch
        return torch.cuda.device_count()
    return usable_cores()


def measure_rows(rows: list[Row], workload: Workload, measure: MeasureFn, max_k: int,
                 checkpoint: str, progress: Callable[[str], None] | None = None,
                 base: tuple[int, int] | None = None,
                 rule: StopRule = CELL_RULE) -> dict[tuple[int, int], Any]:
    """Run every row with K <= max_k on real processes, in alternating rounds of the measurement
    kernel (each row once per round); returns the last measured timeline of each (K, M).

    Each measured row gets its median step time with a 95% interval (``step_figure``, per sample)
    and, against the `base` (K, M) row measured in the same rounds, its normalized throughput as
    the median of per-round paired ratios with its interval (``normalized_figure``)."""
    measured = [r for r in rows if r.K <= max_k]
    timelines: dict[tuple[int, int], Any] = {}
    if not measured:
        return timelines
    base = base or (min(r.K for r in rows), min(r.M for r in rows))

    def name(r: Row) -> str:
        return f"K={r.K} M={r.M}"

    def run(r: Row) -> Callable[[], float]:
        def once() -> float:
            if progress:
                progress(f"measuring {r.model} K={r.K} M={r.M} on {r.K} processes")
            result = measure(workload, r.balance, r.M, r.batch, checkpoint)
            if result.get("timeline") is not None:
                timelines[(r.K, r.M)] = result["timeline"]
            return float(result["step_time_s"]) / r.batch       # seconds per sample
        return once
    ref = next((r for r in measured if (r.K, r.M) == base), None)
    comparisons = [Comparison(name(r), name(ref), name(r)) for r in measured if ref is not None]
    result = measure_rounds({name(r): run(r) for r in measured}, comparisons, rule,
                            label=f"measuring {measured[0].model}")
    for r in measured:
        per_sample = result.times[name(r)]
        r.measured = {"step_time_s": per_sample.value * r.batch, "throughput": 1.0 / per_sample.value,
                      "step_figure": per_sample.to_json(), "host_fast": result.host_fast,
                      "rounds": result.rounds, "stopped": result.stopped}
        if ref is not None:
            fig = result.figures[name(r)]
            r.measured.update(normalized=fig.value, normalized_figure=fig.to_json())
    return timelines


def distributed_measure(settings: SweepSettings, warmup: int = 2) -> MeasureFn:
    """A MeasureFn backed by the distributed runtime."""
    def run(workload: Workload, balance: list[int], m: int, n: int,
            checkpoint: str) -> dict[str, Any]:
        result = measure_pipeline(functools.partial(workload.build, "cpu"), balance, m,
                                  workload.sample(n), checkpoint=checkpoint,
                                  recompute_ahead=settings.recompute_ahead,
                                  schedule=settings.schedule,
                                  split_backwards=settings.split_backwards, loss_fn=workload.loss_fn(),
                                  steps=settings.measure_steps, warmup=warmup,
                                  threads=settings.threads or 1)
        return {"step_time_s": float(result.median_step_time), "step_times": result.step_times,
                "timeline": result.timeline}

    return run

