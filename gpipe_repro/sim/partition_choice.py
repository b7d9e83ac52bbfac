"""A partition choice that reproduces run to run although the costs it is made from are measured.

The exact partitioner (:func:`gpipe_repro.engine.partition.partition`) is deterministic given its
input, but calibrated costs are not: two calibrations minutes apart differ by a few percent, and
where two cuts are nearly tied that is enough to flip the choice (issue #12 saw AmoebaNet K=8 cut as
[4,4,3,2,2,2,3,4] and as [4,3,3,3,3,2,2,4] in two runs). :func:`choose_partition` therefore rounds
each layer's cost to a logarithmic grid of ratio ``1 + resolution`` before partitioning: costs that
differ by less than the grid's width give the same cut, and the cut it gives is within a factor of
about ``1 + resolution`` of the optimum on the unrounded costs (each rounded cost is within a factor
``sqrt(1 + resolution)`` of its true value).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from gpipe_repro.engine.partition import partition

RESOLUTION = 0.05
"""Default grid ratio: costs within 5% of each other are treated as equal for the choice (the
calibration's run-to-run spread on a 2-core host is a few percent)."""


def rounded_costs(costs: Sequence[float], resolution: float = RESOLUTION) -> list[float]:
    """Each cost rounded to the nearest power of ``1 + resolution`` (zero stays zero)."""
    if resolution <= 0:
        raise ValueError(f"resolution must be > 0, got {resolution}")
    step = math.log1p(resolution)
    return [0.0 if c <= 0 else math.exp(round(math.log(c) / step) * step) for c in costs]


def choose_partition(costs: Sequence[float], k: int, objective: str = "bottleneck", *,
                     measured: bool = True, resolution: float = RESOLUTION) -> list[int]:
    """:func:`gpipe_repro.engine.partition.partition` of the costs rounded by :func:`rounded_costs`:
    the same cut for costs that differ only by measurement noise smaller than the grid. Costs that
    are not measured (``measured=False``: FLOP counts, deterministic) are partitioned exactly."""
    if objective in ("equal", "greedy") or not measured:
        return partition(costs, k, objective)
    return partition(rounded_costs(costs, resolution), k, objective)
