"""When a configuration does not fit: why, and what would.

"Does not fit" is not actionable on its own. :func:`why` names the device that overflows, when
(which action of the schedule), and what fills it (parameters, gradients, optimizer state, stashed
boundary activations, the working set). :func:`what_would_fit` tries the three levers the paper
offers, each alone: re-materialization, more micro-batches (a smaller working set), more devices
(fewer layers each); and says how much memory per device the configuration as given would need.
"""
from __future__ import annotations

from gpipe_repro.memory.compose import PERSISTENT
from gpipe_repro.memory.planner import MemoryPlan, MemoryPlanner, gib


def _gib(x: float) -> str:
    return f"{gib(x)} GiB"


def why(plan: MemoryPlan, budget: float) -> str:
    """One sentence about the device that overflows the most."""
    s = plan.stages[plan.bottleneck_stage]
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(s.parts.items(), key=lambda kv: -kv[1]) if v)
    state = sum(s.parts.get(c, 0) for c in PERSISTENT)
    reason = (" Its parameters, gradients and optimizer state alone exceed the budget: only more "
              "devices (or smaller layers) can help." if state > budget else "")
    return (f"device {s.stage} ({plan.balance[s.stage]} layers) needs {_gib(s.peak)} of "
            f"{_gib(budget)}, at its peak during {s.peak_at}: {parts}.{reason}")


def what_would_fit(planner: MemoryPlanner, plan: MemoryPlan, budget: float,
                   max_partitions: int | None = None) -> list[str]:
    """Single changes to `plan`'s configuration that fit `budget` (each one planned)."""
    k, m, ckpt = plan.partitions, plan.micro_batches, plan.checkpoint
    out: list[str] = []
    if ckpt == "never":
        p = planner.plan(k, m, "except_last")
        out.append(f"re-materialization (--checkpoint except_last): {_gib(p.max_peak)} per device"
                   + (" - fits" if p.fits(budget) else " - still too much"))
    m2 = m * 2
    while m2 <= planner.batch:
        p = planner.plan(k, m2, ckpt)
        if p.fits(budget):
            out.append(f"more micro-batches: M={m2} fits ({_gib(p.max_peak)} per device)")
            break
        m2 *= 2
    else:
        out.append(f"more micro-batches alone does not fit (M up to the batch, {planner.batch})")
    limit = min(planner.num_layers, max_partitions or planner.num_layers)
    k2 = k * 2
    while k2 <= limit:
        p = planner.plan(k2, m, ckpt)
        if p.fits(budget):
            out.append(f"more devices: K={k2} fits ({_gib(p.max_peak)} per device)")
            break
        k2 *= 2
    else:
        out.append(f"more devices alone does not fit (up to K={limit})")
    out.append(f"or devices with at least {_gib(plan.max_peak)} each")
    return out


__all__ = ["why", "what_would_fit"]
