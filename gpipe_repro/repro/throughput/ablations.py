"""Bubble curves and the partition-objective and re-materialization ablations (simulated)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpipe_repro.engine.partition import OBJECTIVES
from gpipe_repro.repro.throughput.rows import balance_efficiency
from gpipe_repro.repro.throughput.settings import SweepSettings
from gpipe_repro.sim.calibration import Calibration
from gpipe_repro.sim.partition_choice import choose_partition
from gpipe_repro.sim.platform import Platform
from gpipe_repro.sim.simulator import theoretical_bubble


@dataclass
class BubbleCurve:
    K: int
    ms: list[int]
    simulated: list[float]
    theory: list[float] = field(default_factory=list)


def bubble_curves(calib: Calibration, settings: SweepSettings, platform: Platform, model: str,
                  ks: Sequence[int] = (2, 4, 8),
                  ms: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> list[BubbleCurve]:
    """Simulated bubble fraction against M for each K, beside the paper's (K-1)/(M+K-1)."""
    b = dict(settings.microbatch).get(model, settings.sizes(model)[0])
    if b not in calib.costs:
        b = min(calib.costs)
    costs = calib.partition_costs(b, settings.checkpoint)
    curves = []
    for k in ks:
        balance = choose_partition(costs, k, settings.objective)
        sims = [platform.simulate(calib, balance, m, m * b, settings) for m in ms]
        curves.append(BubbleCurve(k, list(ms), [s.bubble_fraction for s in sims],
                                  [theoretical_bubble(k, m) for m in ms]))
    return curves


def objective_ablation(calib: Calibration, settings: SweepSettings, platform: Platform,
                       model: str, k: int = 8, m: int = 32) -> list[dict[str, Any]]:
    """K x M under each partition objective: what the exact partitioner buys over the paper's
    public heuristic (lingvo's cumulative-cost cut, "greedy") and equal layer counts."""
    b = dict(settings.microbatch)[model]
    costs = calib.partition_costs(b, settings.checkpoint)
    base = platform.simulate(calib, choose_partition(costs, 2, settings.objective), 1, b, settings)
    out = []
    for objective in OBJECTIVES:
        balance = choose_partition(costs, k, objective)
        sim = platform.simulate(calib, balance, m, m * b, settings)
        out.append({"objective": objective, "balance": balance,
                    "balance_efficiency": balance_efficiency(costs, balance),
                    "normalized": sim.throughput / base.throughput})
    return out


def rematerialization_ablation(calib: Calibration, settings: SweepSettings, platform: Platform, model: str,
                      k: int = 8, m: int = 32) -> list[dict[str, Any]]:
    """Absolute and normalized throughput of K x M under each re-materialization setting: why the
    normalized numbers depend on what the K=2, M=1 baseline pays. (The ablation over pipeline
    schedules is :func:`gpipe_repro.repro.throughput.schedules.schedule_tradeoff`.)"""
    b = dict(settings.microbatch)[model]
    out = []
    for checkpoint in ("always", "except_last", "never"):
        costs = calib.partition_costs(b, checkpoint)
        for ahead in ((False, True) if checkpoint != "never" else (False,)):
            base, top = (platform.simulate(calib, choose_partition(costs, kk, settings.objective), mm,
                                           mm * b, settings, checkpoint, ahead)
                         for kk, mm in ((2, 1), (k, m)))
            out.append({"checkpoint": checkpoint, "recompute_ahead": ahead,
                        "base_throughput": base.throughput, "throughput": top.throughput,
                        "normalized": top.throughput / base.throughput})
    return out


