"""A partition choice that reproduces run to run although the costs it is made from are measured.

The exact partitioner (:func:`gpipe_repro.engine.partition.partition`) is deterministic given its
input, but calibrated costs are not: two calibrations minutes apart differ by a few percent, and
where two cuts are nearly tied that is enough to flip the choice.

Part of what keeps the choice stable is in the costs: identical layers get one pooled cost (so the
Transformer's 48 blocks are exact ties, broken the same way every time), and every distinct layer
is timed in interleaved rounds whose median round is kept (:mod:`gpipe_repro.sim.calibration`).
:func:`choose_partition` then partitions the measured costs exactly, unless the caller gives the
calibration's own uncertainty (:meth:`gpipe_repro.sim.calibration.Calibration.uncertainty_at`: the
relative half-width of its per-layer intervals). Then the cuts whose simulated bottleneck lies within
that uncertainty of the optimum, and never less than :data:`TIE_FLOOR`, are all equally good as far
as the measurement can tell, and the choice among them is a documented deterministic tie-break
(:func:`tie_break`): the cut whose cells are the most even in time (the least sum of squared cell
costs), then the lexicographically smallest balance.

Why evenness in time and not in layer count: a tie-break that agrees with the objective keeps the
chosen cut near the optimum, deep inside the window, where a calibration's noise does not move it
out; layer counts disagree with time on a model whose layers differ (AmoebaNet's reduction cells),
so the most even cut in layer count was often the one nearest the window's edge, and two runs
flipped between it and the next (`test_silent_flip_even_layer_counts_chose_a_cut_at_the_windows_edge`:
a cut 0.5% above the optimum in one calibration and 2.2% in the next). Why a floor: a window that
followed each run's own uncertainty (1.0% in one run, 1.4% in the next) flipped every cut whose gap
to the optimum fell between the two; above the floor the calibration's own uncertainty still widens
the window (what it cannot resolve, it does not choose by). Evenness in time is itself measured, so
two cuts nearly equal in it could still trade places; the chosen cut is then within the window of
the optimum either way, which is what the table's cells see.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from gpipe_repro.engine.partition import cell_costs, check_balance, partition
from gpipe_repro.engine.schedule import Schedule
from gpipe_repro.sim.calibration.costs import Calibration

TIE_FLOOR = 0.03
"""The narrowest relative window of near-ties for timed costs (see the module docstring)."""

KEEP_BAND = 2.0
"""A kept cut stays while its bottleneck is within this many windows of ties of the optimum."""

_EQUAL = 1e-9
"""Sums of squared cell costs within this relative distance are equal (a float sum depends on its
order; pooled identical layers make exact ties that rounding must not break)."""


def choose_partition(costs: Sequence[float], k: int, objective: str = "bottleneck",
                     uncertainty: float = 0.0, keep: Sequence[int] | None = None,
                     first: Sequence[float] | None = None) -> list[int]:
    """The balance of `costs` (timed or counted) into `k` cells under `objective`: the exact
    :func:`gpipe_repro.engine.partition.partition`; with the bottleneck objective and a relative
    `uncertainty` > 0 (the calibration's), :func:`tie_break` among the cuts within it of the optimum,
    or within :data:`TIE_FLOOR` where it is smaller, unless `keep` (a cut chosen before, e.g. from
    an earlier calibration) is within :data:`KEEP_BAND` such windows of the optimum: then `keep`
    (see "The kept cut" above). A `keep` that is not a cut of these layers into `k` cells is
    ignored.

    `first`: the layers' costs as the first cell runs them, where that differs from `costs` (a
    zero-bubble schedule's first cell takes no input gradient and runs each backward whole; the
    others run both halves of the split, which cost more: :func:`choose_cut`). The bottleneck
    objective only; its exact optimum, and the tie-break, then count the first cell by `first`."""
    if uncertainty < 0:
        raise ValueError(f"uncertainty must be >= 0 (a relative half-width), got {uncertainty}")
    if first is not None and objective != "bottleneck":
        raise ValueError(f"costs that differ on the first cell are balanced by the bottleneck "
                         f"objective only, not {objective!r}")
    if first is not None and len(first) != len(costs):
        raise ValueError(f"{len(first)} first-cell costs for {len(costs)} layers")
    if first is None:
        best = partition(costs, k, objective)
        if objective != "bottleneck" or uncertainty == 0:
            return best
        optimum = max(cell_costs(costs, best))
    else:
        optimum = _bottleneck_with_first(costs, first, k)
        if uncertainty == 0:
            return tie_break(costs, k, optimum, first)
    window = max(uncertainty, TIE_FLOOR)
    if keep is not None and is_cut(keep, len(costs), k) and \
            max(_cells(costs, keep, first)) <= optimum * (1.0 + KEEP_BAND * window) * (1.0 + 1e-12):
        return list(keep)
    return tie_break(costs, k, optimum * (1.0 + window), first)


def choose_cut(calibration: Calibration, size: int, checkpoint: str, schedule: Schedule,
               objective: str = "bottleneck", keep: Sequence[int] | None = None) -> list[int]:
    """The cut of `calibration`'s layers at micro-batch `size` into `schedule`'s cells, balancing what
    each cell runs: where the schedule splits most backwards (:attr:`Schedule.cut_by_split_costs`:
    zb-h1 and zb-v as their paper writes them), every cell but the first by both
    halves of the split and the first by whole backwards (it takes no input gradient), so the
    costlier split does not leave the later cells the bottleneck on a cut balanced for whole
    backwards; else :meth:`Calibration.partition_costs`.
    Ties and kept cuts as :func:`choose_partition`, within the calibration's own uncertainty."""
    uncertainty = calibration.uncertainty_at(size)
    whole = calibration.partition_costs(size, checkpoint)
    if not schedule.cut_by_split_costs or objective != "bottleneck" or schedule.num_stages == 1:
        return choose_partition(whole, schedule.num_stages, objective, uncertainty, keep)
    return choose_partition(calibration.partition_costs(size, checkpoint, split=True),
                            schedule.num_stages, objective, uncertainty, keep, first=whole)


def _cells(costs: Sequence[float], balance: Sequence[int], first: Sequence[float] | None) -> list[float]:
    """Each cell's cost, the first counted by `first` where given."""
    out = cell_costs(costs, balance)
    if first is not None:
        out[0] = float(sum(first[:balance[0]]))
    return out


def _bottleneck_with_first(costs: Sequence[float], first: Sequence[float], k: int) -> float:
    """The least bottleneck of a cut into `k` cells whose first cell costs `first` per layer."""
    return max(_cells(costs, partition(costs, k, first=first), first))


def bottleneck_excess(costs: Sequence[float], balance: Sequence[int]) -> float:
    """How much slower `balance`'s bottleneck cell is than the optimal cut's (relative; 0 at the
    optimum): what a tie-break or a kept cut gave up on these costs."""
    k = len(balance)
    return max(cell_costs(costs, balance)) / max(cell_costs(costs, partition(costs, k))) - 1.0


def is_cut(balance: Sequence[int], layers: int, k: int) -> bool:
    """Whether `balance` cuts `layers` layers into `k` non-empty cells
    (:func:`gpipe_repro.engine.partition.check_balance` accepts it)."""
    try:
        check_balance(balance, layers, k)
    except ValueError:
        return False
    return True


def tie_break(costs: Sequence[float], k: int, limit: float,
              first: Sequence[float] | None = None) -> list[int]:
    """Among the cuts of `costs` into `k` cells whose every cell costs at most `limit`: the most even
    in time (least sum of squared cell costs; sums within a relative 1e-9 are equal), then the
    lexicographically smallest balance. Exact (dynamic programming over (first layer, cells left),
    O(n^2 k)). `first`: the first cell's costs per layer, where they differ (:func:`choose_partition`)."""
    n = len(costs)
    prefix, head = [0.0], [0.0]
    for c, f in zip(costs, first if first is not None else costs):
        prefix.append(prefix[-1] + float(c))
        head.append(head[-1] + float(f))
    slack = limit * (1.0 + 1e-12)

    def cell(i: int, e: int) -> float:
        return head[e] if i == 0 else prefix[e] - prefix[i]
    # best[j][i]: least sum of squared cell costs cutting layers i.. into j cells within the limit
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]
    best[0][n] = 0.0
    for j in range(1, k + 1):
        for i in range(n - j, -1, -1):
            best[j][i] = min((cell(i, e) ** 2 + best[j - 1][e] for e in range(i + 1, n - j + 2)
                              if cell(i, e) <= slack), default=math.inf)
    if math.isinf(best[k][0]):
        raise ValueError(f"no cut into {k} cells keeps every cell within {limit}: give a limit at "
                         "least the optimal bottleneck")
    balance, i = [], 0
    for j in range(k, 0, -1):   # the smallest first cell of a least sum, cell by cell
        e = next(e for e in range(i + 1, n - j + 2) if cell(i, e) <= slack
                 and cell(i, e) ** 2 + best[j - 1][e] <= best[j][i] * (1.0 + _EQUAL))
        balance.append(e - i)
        i = e
    return balance
