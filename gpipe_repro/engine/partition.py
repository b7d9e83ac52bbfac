"""Cutting L layer costs into K contiguous, non-empty cells.

A pipeline's steady-state throughput is set by its slowest cell, so the objective that matters is the
**bottleneck**: minimize the largest cell cost. We solve it exactly: the smallest feasible cap is
found by bisection over a greedy feasibility test (packing layers left to right is optimal for
"contiguous cells, each under a cap": any feasible partition can be shifted to the greedy one without
raising a cell), and among partitions that attain it we prefer the most even one (least sum of
squares, by dynamic programming when the problem is small enough).

Also here, for comparison and for the paper's own words:

- ``variance``: the paper says it minimizes the variance of cell costs. Exact DP, O(K L^2).
- ``greedy``: lingvo's heuristic (the paper's public code): cut where the cumulative cost share
  crosses k/K.
- ``equal``: equal layer counts, ignoring costs.

A per-device memory cap (each cell's summed ``memory`` must stay under ``memory_cap``) is honoured by
``bottleneck`` and ``variance``; when no K-cell partition can satisfy it, the error says how much the
biggest layer or the whole model needs.
"""
from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Sequence
from typing import Any

from gpipe_repro.engine.choices import require_one_of

__all__ = ["OBJECTIVES", "cell_costs", "check_balance", "finite_non_negative", "partition"]

OBJECTIVES = ("bottleneck", "variance", "greedy", "equal")
_DP_LIMIT = 4_000_000  # K * L^2 above which the exact DP tie-breaker is skipped


def cell_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """Summed cost of each cell of a balance."""
    out, i = [], 0
    for n in balance:
        out.append(float(sum(costs[i:i + n])))
        i += n
    return out


def check_balance(balance: Sequence[int], num_layers: int, partitions: int | None = None) -> None:
    """Raise ValueError naming the fix unless `balance` cuts `num_layers` into non-empty cells."""
    if partitions is not None and len(balance) != partitions:
        raise ValueError(f"balance has {len(balance)} cells but partitions={partitions}: give one "
                         "layer count per partition")
    if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in balance):
        raise ValueError(f"balance {list(balance)} holds a value that is not a whole number of layers "
                         "(a float or a bool): give integers, e.g. balance=[3, 2]")
    if any(n < 0 for n in balance):
        raise ValueError(f"balance {list(balance)} holds a negative count of layers: every cell needs "
                         ">= 1 layer")
    if any(n < 1 for n in balance):
        raise ValueError(f"balance {list(balance)} has an empty cell: every cell needs >= 1 layer")
    if sum(balance) != num_layers:
        raise ValueError(f"balance {list(balance)} sums to {sum(balance)} but the model has "
                         f"{num_layers} layers: the counts must add up to {num_layers}")


def finite_non_negative(what: str, values: Sequence[Any]) -> list[float]:
    """`values` as floats, each a finite number >= 0, or a ValueError naming `what` and the first
    that is not (a NaN compares false with everything: a NaN cost cut a model silently)."""
    out = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: entry {i} is {v!r}, not a number") from None
        if not math.isfinite(f) or f < 0:
            raise ValueError(f"{what} must be finite numbers >= 0; entry {i} is {v!r}")
        out.append(f)
    return out


def partition(costs: Sequence[float], partitions: int, objective: str = "bottleneck",
              memory: Sequence[float] | None = None, memory_cap: float | None = None,
              first: Sequence[float] | None = None) -> list[int]:
    """Return a balance (layers per cell) of `costs` into `partitions` cells under `objective`.

    `first`: the layers' costs as the first cell runs them, where they differ from `costs` (a
    zero-bubble schedule's first cell takes no input gradient and runs each backward whole, the
    others both halves of the split, where most backwards split: :attr:`Schedule.cut_by_split_costs`). The
    bottleneck objective
    only: the least bottleneck with the first cell counted by `first`, then the most even."""
    if isinstance(partitions, bool) or not isinstance(partitions, numbers.Integral):
        raise ValueError(f"partitions must be a whole number of cells, got {partitions!r}")
    n = len(costs)
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    if partitions > n:
        raise ValueError(f"partitions={partitions} is larger than the number of layers ({n}): use "
                         f"partitions <= {n}, or split the model into more, smaller layers")
    costs = finite_non_negative("layer costs", costs)
    require_one_of("objective", objective, OBJECTIVES)
    if (memory is None) != (memory_cap is None):
        raise ValueError("give both memory (per-layer bytes) and memory_cap, or neither")
    if memory is not None:
        if len(memory) != n:
            raise ValueError(f"{len(memory)} memory entries for {n} layers")
        memory = finite_non_negative("memory", memory)
        memory_cap = finite_non_negative("memory_cap", [memory_cap])[0]
        _check_memory_fits(memory, partitions, memory_cap)
        if objective in ("greedy", "equal"):
            raise ValueError(f"objective {objective!r} ignores costs and cannot honour a memory cap; "
                             "use 'bottleneck' or 'variance'")
    if first is not None:
        if objective != "bottleneck" or memory is not None:
            raise ValueError("first-cell costs are balanced by the bottleneck objective, without a "
                             f"memory cap (got objective={objective!r}"
                             f"{', a memory cap' if memory is not None else ''})")
        if len(first) != n:
            raise ValueError(f"first needs one cost >= 0 per layer ({n}), got {len(first)}")
        return _min_bottleneck_first(costs, finite_non_negative("first", first), partitions)
    if objective == "equal":
        return [n // partitions + (1 if i < n % partitions else 0) for i in range(partitions)]
    if objective == "greedy":
        return _greedy_share(costs, partitions)
    if objective == "variance":
        balance = _min_squares(costs, partitions, cap=None, memory=memory, memory_cap=memory_cap)
        if balance is None:
            raise ValueError("no partition satisfies the memory cap")  # unreachable after the check
        return balance
    return _min_bottleneck(costs, partitions, memory, memory_cap)


def _check_memory_fits(memory: Sequence[float], k: int, cap: float | None) -> None:
    assert cap is not None
    if max(memory) > cap:
        i = max(range(len(memory)), key=lambda j: memory[j])
        raise ValueError(f"layer {i} alone needs {memory[i]:.4g} but the cap per device is {cap:.4g}: "
                         "no partition fits; use devices with more memory or split that layer")
    if _greedy_count(memory, cap, [0.0] * len(memory), float("inf")) > k:
        raise ValueError(f"the model needs {sum(memory):.4g} in all, which does not fit in {k} cells of "
                         f"{cap:.4g}: use more partitions, devices with more memory, or more "
                         "micro-batches / re-materialization to shrink activations")


def _packed_total(costs: Sequence[float]) -> float:
    """The total the greedy packers reach, accumulated as they do (``acc + c``, left to right)."""
    acc = 0.0
    for c in costs:
        acc = acc + c
    return acc


def _greedy_count(costs: Sequence[float], cap: float, memory: Sequence[float], mem_cap: float) -> int:
    """Cells that left-to-right packing needs with every cell's cost <= cap and memory <= mem_cap."""
    cells, acc, mem = 1, 0.0, 0.0
    for c, b in zip(costs, memory):
        if c > cap or b > mem_cap:
            return len(costs) + 1
        if acc + c > cap or mem + b > mem_cap:
            cells, acc, mem = cells + 1, c, b
        else:
            acc, mem = acc + c, mem + b
    return cells


def _greedy_cuts(costs: Sequence[float], cap: float, memory: Sequence[float], mem_cap: float,
                 k: int) -> list[int]:
    """Left-to-right packing into exactly k non-empty cells (splitting the last ones if fewer)."""
    balance, acc, mem = [0], 0.0, 0.0
    for c, b in zip(costs, memory):
        if balance[-1] and (acc + c > cap or mem + b > mem_cap):
            balance.append(0)
            acc = mem = 0.0
        balance[-1] += 1
        acc, mem = acc + c, mem + b
    # Fewer cells than k: peel single layers off the largest cells (never raises a cell's cost).
    while len(balance) < k:
        i = max(range(len(balance)), key=lambda j: balance[j])
        balance[i:i + 1] = [balance[i] - 1, 1]
    return balance


def _min_bottleneck(costs: list[float], k: int, memory: Sequence[float] | None,
                    memory_cap: float | None) -> list[int]:
    mem = list(memory) if memory is not None else [0.0] * len(costs)
    mcap = memory_cap if memory_cap is not None else float("inf")
    # hi: the packers' own left-to-right total, not sum(): from Python 3.12 on, sum() of floats is
    # compensated and can land one ulp below `acc + c`, so one cell capped at sum() did not fit the
    # whole model and K=1 came back as two cells (found by hypothesis on Python 3.12).
    lo, hi = max(costs), _packed_total(costs)
    if _greedy_count(costs, lo, mem, mcap) <= k:
        hi = lo
    for _ in range(200):
        if hi - lo <= 1e-12 * max(hi, 1e-300):
            break
        mid = (lo + hi) / 2
        if _greedy_count(costs, mid, mem, mcap) <= k:
            hi = mid
        else:
            lo = mid
    best = _greedy_cuts(costs, hi, mem, mcap, k)
    if len(best) != k:      # an invariant of the search above; never return a wrong cell count
        raise RuntimeError(f"internal error: the bottleneck search packed {len(costs)} layers into "
                           f"{len(best)} cells instead of {k}; please report it with the costs")
    bottleneck = max(cell_costs(costs, best))
    if k * len(costs) ** 2 <= _DP_LIMIT:
        even = _min_squares(costs, k, cap=bottleneck * (1 + 1e-12), memory=memory, memory_cap=memory_cap)
        if even is not None:
            return even
    # Too big for the full DP: the same DP with each cut confined to a window around its
    # equal-share position (exact within the window; greedy packing if the window is infeasible).
    even = _min_squares(costs, k, cap=bottleneck * (1 + 1e-12), memory=memory, memory_cap=memory_cap,
                        window=max(4, 3 * len(costs) // k))
    return even if even is not None else best


def _min_squares(costs: list[float], k: int, cap: float | None, memory: Sequence[float] | None,
                 memory_cap: float | None, window: int | None = None) -> list[int] | None:
    """Exact DP: minimize the sum of squared cell costs (= variance, the total being fixed),
    optionally with every cell's cost <= cap and memory <= memory_cap. None if infeasible.
    With `window`, the end of cell j is confined to +-window layers of where the cumulative cost
    crosses j/k of the total (O(k * window^2) instead of O(k * n^2))."""
    n = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    mpre = [0.0]
    for b in (memory or [0.0] * n):
        mpre.append(mpre[-1] + b)
    inf = float("inf")
    # best[j][i]: min sum of squares of the first i layers in j cells; arg for the last cut.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    ranges = [(j, n - (k - j)) for j in range(k + 1)]
    if window is not None:
        total = pre[-1] or 1.0
        for j in range(1, k):
            ideal = _crossing(pre, total * j / k)
            lo, hi = ranges[j]
            ranges[j] = (max(lo, ideal - window), min(hi, ideal + window))
    for j in range(1, k + 1):
        lo_i, hi_i = ranges[j]
        for i in range(lo_i, hi_i + 1):
            row_best, row_arg = inf, 0
            t_lo, t_hi = ranges[j - 1]
            for t in range(max(j - 1, t_lo), min(i, t_hi + 1)):
                if best[j - 1][t] == inf:
                    continue
                c = pre[i] - pre[t]
                if cap is not None and c > cap:
                    continue
                if memory_cap is not None and mpre[i] - mpre[t] > memory_cap:
                    continue
                v = best[j - 1][t] + c * c
                if v < row_best:
                    row_best, row_arg = v, t
            best[j][i], arg[j][i] = row_best, row_arg
    if best[k][n] == inf:
        return None
    balance, i = [], n
    for j in range(k, 0, -1):
        t = arg[j][i]
        balance.append(i - t)
        i = t
    return balance[::-1]


def _min_bottleneck_first(costs: list[float], first: list[float], k: int) -> list[int]:
    """The bottleneck cut whose first cell costs `first` per layer: each first cell in turn, the rest
    cut by :func:`_min_bottleneck`; the least (bottleneck, sum of squared cell costs), the first
    such."""
    n = len(costs)
    if k == 1:
        return [n]
    best: tuple[float, float] | None = None
    balance: list[int] = []
    head = 0.0
    for e in range(1, n - k + 2):
        head += first[e - 1]
        if best is not None and head > best[0]:
            break       # costs are >= 0: a longer first cell only costs more
        rest = _min_bottleneck(costs[e:], k - 1, None, None)
        cells = [head, *cell_costs(costs[e:], rest)]
        key = (max(cells), sum(c * c for c in cells))
        if best is None or key < best:
            best, balance = key, [e, *rest]
    return balance


def _crossing(prefix: list[float], target: float) -> int:
    """Index i whose prefix sum is closest to `target` (prefix is non-decreasing)."""
    i = bisect.bisect_left(prefix, target)
    if i >= len(prefix):
        return len(prefix) - 1
    return i if i == 0 or prefix[i] - target < target - prefix[i - 1] else i - 1


def _greedy_share(costs: list[float], k: int) -> list[int]:
    """lingvo's cut: layer i goes to the cell whose share of the total its cumulative cost falls in."""
    total = sum(costs) or 1.0
    n = len(costs)
    cuts, acc = [], 0.0
    for c in costs:
        acc += c
        cell = min(int(acc / total * k - 1e-12), k - 1)
        cuts.append(cell)
    balance = [cuts.count(j) for j in range(k)]
    # The share rule can leave a cell empty (one heavy layer spans several shares): borrow a layer
    # from a neighbour so every cell is non-empty, as a runtime needs.
    for j in range(k):
        if balance[j] == 0:
            donor = max(range(k), key=lambda d: balance[d])
            balance[donor] -= 1
            balance[j] += 1
    assert sum(balance) == n
    return balance
