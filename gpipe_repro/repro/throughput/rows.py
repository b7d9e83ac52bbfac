"""Table rows: partition and simulate every (K, M), normalize, attach the paper-size FLOP model."""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from gpipe_repro.engine.partition import cell_costs
from gpipe_repro.models.workload import Workload
from gpipe_repro.report.host import is_clean
from gpipe_repro.repro.throughput.settings import SweepSettings
from gpipe_repro.sim.calibration import Calibration, calibrate
from gpipe_repro.sim.devices import DEVICES
from gpipe_repro.sim.partition_choice import bottleneck_excess, choose_partition
from gpipe_repro.sim.platform import Platform
from gpipe_repro.sim.simulator import theoretical_bubble


@dataclass
class Row:
    """One (model, K, M) configuration of a throughput table."""

    model: str
    K: int
    M: int
    microbatch: int
    batch: int
    balance: list[int]
    balance_efficiency: float        # mean cell cost / slowest cell cost
    simulated: dict[str, Any]        # Simulation.summary() + "normalized"
    measured: dict[str, Any] | None = None   # {"step_time_s", "throughput", "normalized"}
    flop_model: dict[str, Any] | None = None  # paper-size FLOP-cost simulation
    paper: float | None = None
    torchgpipe: float | None = None
    cut_kept: bool = False           # the balance is the earlier table's (repro/throughput/kept_cuts)
    bottleneck_excess: float = 0.0   # its bottleneck cell over the optimal cut's, minus 1 (these costs)

    @property
    def bubble_theory(self) -> float:
        return theoretical_bubble(self.K, self.M)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["bubble_theory"] = self.bubble_theory
        return out


def balance_efficiency(costs: Sequence[float], balance: Sequence[int]) -> float:
    cells = cell_costs(costs, balance)
    return statistics.fmean(cells) / max(cells)


def simulate_rows(model: str, calib: Calibration, settings: SweepSettings, platform: Platform,
                  ks: Sequence[int], ms: Sequence[int], *, base: tuple[int, int] | None = None,
                  paper_values: dict[tuple[int, int], float] | None = None,
                  peer_values: dict[tuple[int, int], float] | None = None,
                  microbatch: Callable[[int], int] | None = None,
                  batch: Callable[[int], int] | None = None,
                  keep: Mapping[tuple[int, int, int], Sequence[int]] | None = None) -> list[Row]:
    """Partition and simulate every (K, M); normalize to `base` (default: smallest K, smallest M).
    `keep`: (K, M, micro-batch size) -> a cut chosen before, kept where its bottleneck is still within
    the kept-cut band of these costs' optimum (:func:`gpipe_repro.sim.partition_choice.choose_partition`)."""
    microbatch = microbatch or (lambda m: settings.microbatch_size(model, m))
    batch = batch or (lambda m: settings.batch_size(model, m))
    rows = []
    for k in ks:
        for m in ms:
            b, n = microbatch(m), batch(m)
            costs = calib.partition_costs(b, settings.checkpoint)
            earlier = (keep or {}).get((k, m, b))
            balance = choose_partition(costs, k, settings.objective, calib.uncertainty_at(b),
                                       keep=earlier)
            sim = platform.simulate(calib, balance, m, n, settings)
            rows.append(Row(model, k, m, b, n, balance, balance_efficiency(costs, balance),
                            sim.summary(),
                            paper=(paper_values or {}).get((k, m)),
                            torchgpipe=(peer_values or {}).get((k, m)),
                            cut_kept=earlier is not None and list(earlier) == balance,
                            bottleneck_excess=bottleneck_excess(costs, balance)))
    normalize(rows, base or (min(ks), min(ms)))
    return rows


def normalize(rows: list[Row], base: tuple[int, int]) -> None:
    """Fill "normalized" of the simulated and measured results, relative to the `base` (K, M) row
    (a measured cell normalized by the measurement kernel, with its interval, is kept as it is)."""
    ref = next((r for r in rows if (r.K, r.M) == base), None)
    if ref is None:
        raise ValueError(f"no row for the normalization base K={base[0]}, M={base[1]}")
    for r in rows:
        r.simulated["normalized"] = r.simulated["throughput"] / ref.simulated["throughput"]
        if r.measured is not None and ref.measured is not None and "normalized_figure" not in r.measured:
            r.measured["normalized"] = r.measured["throughput"] / ref.measured["throughput"]
            # A ratio is as clean as the less clean of its two measurements.
            states = [is_clean(x.get("host")) for x in (r.measured, ref.measured)]
            r.measured["normalized_clean"] = (False if False in states else
                                              None if None in states else True)
        if r.flop_model is not None and ref.flop_model is not None:
            r.flop_model["normalized"] = r.flop_model["throughput"] / ref.flop_model["throughput"]


def flop_model_rows(model: str, workload: Workload, device: str, platform: Platform,
                    settings: SweepSettings, ks: Sequence[int], ms: Sequence[int],
                    microbatch: int) -> list[Row]:
    """The paper's exact model with FLOP costs on a device model (deterministic, no hardware)."""
    calib = calibrate(workload, [microbatch], method="flops", device_model=DEVICES[device])
    flop_settings = replace(settings, policy="micro", microbatch=((model, microbatch),))
    return simulate_rows(model, calib, flop_settings, platform, ks, ms)


def attach_flop_model(rows: list[Row], flop_rows: list[Row]) -> None:
    by_key = {(r.K, r.M): r for r in flop_rows}
    for r in rows:
        f = by_key.get((r.K, r.M))
        if f is not None:
            r.flop_model = {"throughput": f.simulated["throughput"],
                            "normalized": f.simulated["normalized"], "balance": f.balance,
                            "balance_efficiency": f.balance_efficiency,
                            "bubble_fraction": f.simulated["bubble_fraction"]}

