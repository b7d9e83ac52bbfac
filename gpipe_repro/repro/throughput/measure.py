"""Measured cells: real stage processes of the distributed runtime where K fits the host."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from gpipe_repro.distributed.measure import measure_pipeline
from gpipe_repro.models.workload import Workload
from gpipe_repro.report.host import HostWatch, is_clean, usable_cores, wait_for_idle
from gpipe_repro.repro.throughput.rows import Row, normalize
from gpipe_repro.repro.throughput.settings import SweepSettings

MeasureFn = Callable[[Workload, list[int], int, int, str], dict[str, Any]]
"""(workload, balance, M, batch, checkpoint) -> {"step_time_s", "step_times", "timeline"}."""



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
                 wait_idle: float = 0.0) -> dict[tuple[int, int], Any]:
    """Run every row with K <= max_k on real processes; returns the measured timelines by (K, M)."""
    timelines = {}
    for r in rows:
        if r.K > max_k:
            continue
        if progress:
            progress(f"measuring {r.model} K={r.K} M={r.M} on {r.K} processes")
        if wait_idle > 0:
            wait_for_idle(wait_idle)
        with HostWatch() as watch:       # idle before, other processes' CPU during
            result = measure(workload, r.balance, r.M, r.batch, checkpoint)
        host = watch.conditions
        host["clean"] = is_clean(host)
        r.measured = {"step_time_s": result["step_time_s"],
                      "step_times_s": result.get("step_times"),
                      "throughput": r.batch / result["step_time_s"], "host": host}
        if result.get("timeline") is not None:
            timelines[(r.K, r.M)] = result["timeline"]
    if any(r.measured for r in rows):
        normalize(rows, base or (min(r.K for r in rows), min(r.M for r in rows)))
    return timelines


def distributed_measure(settings: SweepSettings, warmup: int = 2) -> MeasureFn:
    """A MeasureFn backed by the distributed runtime."""
    def run(workload: Workload, balance: list[int], m: int, n: int,
            checkpoint: str) -> dict[str, Any]:
        result = measure_pipeline(functools.partial(workload.build, "cpu"), balance, m,
                                  workload.sample(n), checkpoint=checkpoint,
                                  recompute_ahead=settings.recompute_ahead,
                                  schedule=settings.schedule, loss_fn=workload.loss_fn(),
                                  steps=settings.measure_steps, warmup=warmup,
                                  threads=settings.threads or 1)
        return {"step_time_s": float(result.median_step_time), "step_times": result.step_times,
                "timeline": result.timeline}

    return run

