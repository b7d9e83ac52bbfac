"""Table 1's searches: the largest model that fits a per-device budget, by bisection on the planner.

Memory grows with depth L and width D, so "does it fit" is monotone in each and the largest fitting
value is found by bisection (a dozen plans, not a scan). Identical layers are profiled once and the
profiles are shared across every plan of a search through one :class:`ProfileCache`, so changing L
costs a few stage walks and changing D costs one profile per distinct cell.

- Transformer-L (d 2048, ff 8192, 32 heads, 32k vocabulary, batch 32 x 1024 tokens): the largest L.
- AmoebaNet-D (L, D) at 224x224, batch 128, on the paper's grid (D in steps of 16, L in multiples
  of 3): at the row's depth L the widest D, then at that width the deepest L. (Maximizing the
  parameter count over the whole grid is not what the paper did, and costs a profile set per D:
  its optimum is a very shallow, very wide net, e.g. a 3-cell AmoebaNet, since parameters grow as
  D^2 but activations as D.)

Models are described as runs of identical layers built once on the meta device
(:func:`transformer_runs`, :func:`amoebanet_runs`), so no search builds thousands of modules.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpipe_repro.memory.planner import MemoryPlan, MemoryPlanner
from gpipe_repro.memory.profile import ProfileCache, rmsprop, rmsprop_foreach
from gpipe_repro.models.signature import LayerRun, compress
from gpipe_repro.paper import TABLE1_AMOEBANET, TABLE1_TRANSFORMER


@dataclass(frozen=True)
class Row:
    """One column of Table 1: K devices, M micro-batches, re-materialization or not."""

    name: str
    partitions: int
    micro_batches: int
    checkpoint: str

    @classmethod
    def naive(cls) -> Row:
        return cls("Naive-1", 1, 1, "never")

    @classmethod
    def pipeline(cls, partitions: int, micro_batches: int) -> Row:
        return cls(f"Pipeline-{partitions}", partitions, micro_batches, "except_last")


@dataclass
class Found:
    """The outcome of one row's search."""

    row: Row
    size: tuple[int, ...] | None        # (L,) or (L, D); None when nothing fits
    plan: MemoryPlan | None
    tried: list[dict[str, Any]] = field(default_factory=list)   # every (size, fits, peak) planned
    deeper: tuple[int, ...] | None = None      # AmoebaNet: the deepest L at the width found
    deeper_plan: MemoryPlan | None = None


def largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The largest x in [lo, hi] with fits(x), for a monotone predicate (True then False)."""
    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# -- the models as runs of identical layers ---------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _transformer_template(d_model: int, d_ff: int, heads: int, vocab: int) -> tuple[LayerRun, ...]:
    from gpipe_repro.models.transformer_lm import transformer_lm
    with torch.device("meta"):
        return tuple(compress(list(transformer_lm(1, d_model=d_model, d_ff=d_ff, num_heads=heads,
                                                  vocab_size=vocab))))


def transformer_runs(L: int, d_model: int = 2048, d_ff: int = 8192, heads: int = 32,
                     vocab: int = 32000) -> list[LayerRun]:
    """Transformer-L as runs: embedding, L equal layers, head (built once, on the meta device)."""
    embed, layer, head = _transformer_template(d_model, d_ff, heads, vocab)
    return [embed, LayerRun(layer.layer, L), head] if L > 0 else [embed, head]


@functools.lru_cache(maxsize=64)
def _amoebanet_template(L: int, D: int) -> tuple[tuple[str, LayerRun], ...]:
    from gpipe_repro.models.amoebanet import amoebanet
    with torch.device("meta"):
        model = amoebanet(L, D)
    return tuple((name, LayerRun(layer, 1)) for name, layer in model.named_children())


def amoebanet_runs(L: int, D: int) -> list[LayerRun]:
    """AmoebaNet-D (L, D) as runs. Each stack of L/3 normal cells is a first cell (its `prev` comes
    from a reduction), a second, and L/3 - 2 identical ones, so any L >= 9 is AmoebaNet(9, D) with
    the third cell of each stack repeated."""
    if L % 3 or L < 3:
        raise ValueError(f"L must be a positive multiple of 3, got {L}")
    if L < 9:
        return [run for _, run in _amoebanet_template(L, D)]
    repeat = L // 3 - 2
    return [LayerRun(run.layer, repeat if name in ("cell_2", "cell_5", "cell_8") else 1)
            for name, run in _amoebanet_template(9, D)]


def transformer_batch() -> tuple[torch.Tensor, torch.Tensor]:
    t = TABLE1_TRANSFORMER
    shape = (t["batch"], t["seq_len"])
    return (torch.empty(shape, dtype=torch.long, device="meta"),
            torch.empty(shape, dtype=torch.long, device="meta"))


def amoebanet_batch() -> tuple[torch.Tensor, torch.Tensor]:
    a = TABLE1_AMOEBANET
    n, s = a["batch"], a["image_size"]
    return (torch.empty(n, 3, s, s, device="meta"), torch.empty(n, dtype=torch.long, device="meta"))


def transformer_planner(L: int, cache: ProfileCache, attention: str = "fused",
                        optimizer_foreach: bool = True) -> MemoryPlanner:
    from gpipe_repro.models.transformer_lm import lm_loss
    x, y = transformer_batch()
    return MemoryPlanner(transformer_runs(L), x, y, lm_loss,
                         rmsprop_foreach if optimizer_foreach else rmsprop, attention,
                         optimizer_foreach, cache)


def amoebanet_planner(L: int, D: int, cache: ProfileCache,
                      optimizer_foreach: bool = True) -> MemoryPlanner:
    from gpipe_repro.models.amoebanet import amoebanet_loss
    x, y = amoebanet_batch()
    return MemoryPlanner(amoebanet_runs(L, D), x, y, amoebanet_loss,
                         rmsprop_foreach if optimizer_foreach else rmsprop, "fused",
                         optimizer_foreach, cache)


# -- the searches -------------------------------------------------------------------------------------

def _try(planner: MemoryPlanner, row: Row, budget: float, size: tuple[int, ...],
         found: Found) -> tuple[bool, MemoryPlan | None]:
    if planner.num_layers < row.partitions:
        found.tried.append({"size": list(size), "fits": False, "why": "fewer layers than devices"})
        return False, None
    plan = planner.plan(row.partitions, row.micro_batches, row.checkpoint)
    ok = plan.fits(budget)
    found.tried.append({"size": list(size), "fits": ok, "max_peak_bytes": plan.max_peak})
    return ok, plan


def search_transformer(row: Row, budget: float, cache: ProfileCache, attention: str = "fused",
                       max_layers: int = 1 << 14) -> Found:
    """The largest L whose Transformer-L fits `row` under `budget` bytes per device."""
    found = Found(row, None, None)
    plans: dict[int, MemoryPlan] = {}

    def fits(L: int) -> bool:
        ok, plan = _try(transformer_planner(L, cache, attention), row, budget, (L,), found)
        if ok and plan is not None:
            plans[L] = plan
        return ok

    # An upper bound from parameters alone (12 bytes each, ~50M per layer), then bisection.
    per_layer = 12 * (4 * 2048 ** 2 + 2 * 2048 * 8192)
    hi = min(max_layers, int(row.partitions * budget / per_layer) + 2)
    best = largest(max(0, row.partitions - 2), max(hi, row.partitions), fits)
    if best is not None:
        found.size, found.plan = (best,), plans[best]
    return found


def largest_fitting(lo: int, hi: int, peak: Callable[[int], float], budget: float,
                    guesses: tuple[int, ...] = ()) -> int | None:
    """The largest x in [lo, hi] with peak(x) <= budget, for an increasing peak(x).

    Bisection that picks its probes by interpolating the peaks measured so far (quadratic through
    the three nearest, else linear), falling back to the midpoint: memory is close to quadratic in a
    width, so it usually brackets the answer in four or five probes instead of log2(hi - lo)."""
    known: dict[int, float] = {}

    def probe(x: int) -> None:
        if x not in known:
            known[x] = peak(x)

    for g in guesses:
        probe(min(hi, max(lo, g)))
    while True:
        fit = [x for x, v in known.items() if v <= budget]
        fail = [x for x, v in known.items() if v > budget]
        a = max(fit) if fit else None
        b = min(fail) if fail else None
        if a is None:
            if lo in known:
                return None
            probe(lo)
            continue
        if b is None:
            if hi in known:
                return hi
            b_guess = _crossing(known, budget)
            probe(min(hi, max(a + 1, int(b_guess) + 1 if b_guess is not None else hi)))
            continue
        if b - a <= 1:
            return a
        guess = _crossing(known, budget)
        x = int(guess) if guess is not None else (a + b) // 2
        if not a < x < b or x in known:
            x = (a + b) // 2
        probe(x)
        if known[x] <= budget and x + 1 < b:
            probe(x + 1)       # the interpolation is usually right: confirm the step above fails


def _crossing(known: dict[int, float], budget: float) -> float | None:
    """Where a curve through the known points (x, peak) reaches `budget`."""
    pts = sorted(known.items(), key=lambda kv: abs(kv[1] - budget))[:3]
    pts.sort()
    if len(pts) >= 3:
        import numpy as np
        xs, ys = zip(*pts)
        c = np.polyfit(xs, ys, 2)
        roots = [r.real for r in np.roots([c[0], c[1], c[2] - budget]) if abs(r.imag) < 1e-9]
        inside = [r for r in roots if min(xs) - 1 <= r <= max(xs) + 1] or [
            r for r in roots if r > 0]
        if inside:
            return min(inside, key=lambda r: abs(r - xs[1]))
    if len(pts) >= 2:
        (x0, y0), (x1, y1) = pts[0], pts[-1]
        if y1 != y0:
            return x0 + (budget - y0) * (x1 - x0) / (y1 - y0)
    return None


def search_amoebanet(row: Row, budget: float, cache: ProfileCache, L: int, d_step: int = 16,
                     d_max: int = 4096, deepen: bool = True) -> Found:
    """The widest AmoebaNet-D (L, D) that fits `row` (D a multiple of `d_step`); with `deepen`,
    then the deepest L (a multiple of 3) at that width, a second point of the (L, D) frontier.

    Every distinct D costs one profile per distinct cell (the cost of this search), L is free."""
    found = Found(row, None, None)
    plans: dict[tuple[int, int], MemoryPlan] = {}

    def peak(L_: int, D: int) -> float:
        planner = amoebanet_planner(L_, D, cache)
        ok, plan = _try(planner, row, budget, (L_, D), found)
        if plan is None:
            return float("inf")
        plans[(L_, D)] = plan
        return float(plan.max_peak)

    k = largest_fitting(1, d_max // d_step, lambda i: peak(L, i * d_step), budget,
                        guesses=(256 // d_step, 512 // d_step))
    if k is None:
        return found
    D = k * d_step
    found.size, found.plan = (L, D), plans[(L, D)]
    if deepen:
        thirds = largest_fitting(L // 3, 4 * L, lambda t: peak(3 * t, D), budget)
        if thirds is not None and 3 * thirds > L:
            found.deeper = (3 * thirds, D)
            found.deeper_plan = plans[(3 * thirds, D)]
    return found


__all__ = ["Row", "Found", "largest", "transformer_runs", "amoebanet_runs", "transformer_planner",
           "amoebanet_planner", "search_transformer", "search_amoebanet", "transformer_batch",
           "amoebanet_batch"]
