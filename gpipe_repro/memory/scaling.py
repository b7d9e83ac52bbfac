"""Peak activation memory of a fixed model as M and K change, against the paper's O(N + (L/K)(N/M)).

With re-materialization a device keeps its cell's boundary input for all M micro-batches (N examples
in all: the O(N) term) and, during one recompute + backward, the working set of its L/K layers for
one micro-batch of N/M examples (the second term). So a device's peak activation should fall as
1/(K M) towards a floor set by the stash. :func:`activation_grid` plans the grid,
:func:`fit_paper_model` fits ``a + b / (K M)`` by least squares and reports how well that shape
explains the planner's numbers (R^2 on the grid).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gpipe_repro.memory.planner import GiB, MemoryPlanner


def activation_grid(planner: MemoryPlanner, ks: Sequence[int], ms: Sequence[int],
                    checkpoint: str = "except_last") -> list[dict[str, Any]]:
    """Per (K, M): the largest per-device activation peak, its stash part, and the sum over devices."""
    out = []
    for k in ks:
        for m in ms:
            if m > planner.batch or k > planner.num_layers:
                continue
            plan = planner.plan(k, m, checkpoint)
            worst = max(plan.stages, key=lambda s: s.activation_peak)
            out.append({"K": k, "M": m, "max_device_activation_gib": worst.activation_peak / GiB,
                        "stash_gib": worst.parts.get("stash", 0) / GiB,
                        "sum_activation_gib": plan.activation_memory / GiB,
                        "max_device_peak_gib": plan.max_peak / GiB})
    return out


def fit_paper_model(grid: Sequence[dict[str, Any]], key: str = "max_device_activation_gib",
                    ) -> dict[str, float]:
    """Least-squares fit of ``a + b / (K M)`` to the grid; returns a, b and R^2."""
    x = np.array([1.0 / (g["K"] * g["M"]) for g in grid])
    y = np.array([g[key] for g in grid])
    design = np.stack([np.ones_like(x), x], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    pred = a + b * x
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
    return {"a_gib": float(a), "b_gib": float(b), "r2": 1.0 - ss_res / ss_tot}


def is_monotone(grid: Sequence[dict[str, Any]], key: str = "max_device_activation_gib",
                tolerance: float = 1e-9) -> dict[str, bool]:
    """Whether the activation peak never rises with M at fixed K, nor with K at fixed M."""
    table = {(g["K"], g["M"]): g[key] for g in grid}
    ks = sorted({k for k, _ in table})
    ms = sorted({m for _, m in table})
    in_m = all(table[(k, a)] + tolerance >= table[(k, b)]
               for k in ks for a, b in zip(ms, ms[1:]) if (k, a) in table and (k, b) in table)
    in_k = all(table[(a, m)] + tolerance >= table[(b, m)]
               for m in ms for a, b in zip(ks, ks[1:]) if (a, m) in table and (b, m) in table)
    return {"falls_with_M": in_m, "falls_with_K": in_k}


__all__ = ["activation_grid", "fit_paper_model", "is_monotone"]
