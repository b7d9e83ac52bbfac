"""When a configuration does not fit: why, and what would.

"Does not fit" is not actionable on its own. :func:`why` names the device that overflows, when
(which action of the schedule), and what fills it (parameters, gradients, optimizer state, stashed
boundary activations, the working set). :func:`what_would_fit` tries the three levers the paper
offers, each alone: re-materialization, more micro-batches (a smaller working set), more devices
(fewer layers each); and says how much memory per device the configuration as given would need.
"""
from __future__ import annotations

from gpipe_repro.memory.compose import PERSISTENT
from gpipe_repro.memory.planner import MemoryPlan, MemoryPlanner, gib, gib_apart

#: Re-materialization from none to the most: each mode keeps less than the one before.
REMATERIALIZATION = ("never", "except_last", "always")


def _gib(x: float) -> str:
    return f"{gib(x)} GiB"


def why(plan: MemoryPlan, budget: float) -> str:
    """One sentence about the device that overflows the most."""
    owner, peaks = plan.device_of_cells, plan.device_peaks
    device = max(range(len(peaks)), key=peaks.__getitem__)
    cells = [s for s in plan.stages if owner[s.stage] == device]
    s = max(cells, key=lambda c: c.peak)
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(s.parts.items(), key=lambda kv: -kv[1]) if v)
    state = sum(c.parts.get(name, 0) for c in cells for name in PERSISTENT)
    reason = (" Its parameters, gradients and optimizer state alone exceed the budget: only more "
              "devices (or smaller layers) can help." if state > budget else "")
    if len(cells) == 1:
        need, have = gib_apart(s.peak, budget)
        return (f"device {device} ({plan.balance[s.stage]} layers) needs {need} GiB of "
                f"{have} GiB, at its peak during {s.peak_at}: {parts}.{reason}")
    held = ", ".join(str(c.stage) for c in cells)
    layers = sum(plan.balance[c.stage] for c in cells)
    need, have = gib_apart(peaks[device], budget)
    return (f"device {device} (cells {held}: {layers} layers) needs {need} GiB of "
            f"{have} GiB, its cells' actions walked together; its largest, cell "
            f"{s.stage}, peaks during {s.peak_at}: {parts}.{reason}")


def what_would_fit(planner: MemoryPlanner, plan: MemoryPlan, budget: float,
                   max_partitions: int | None = None) -> list[str]:
    """Single changes to `plan`'s configuration that fit `budget`, each planned with the same
    schedule and split count. K counts partitions (cells) as ``GPipe(partitions=K)`` does: one
    device each, or for a schedule with several cells per device, K / (its cells per device)."""
    cells, m, ckpt = plan.partitions, plan.micro_batches, plan.checkpoint
    per = cells // len(plan.device_peaks)

    def planned(k: int, micro_batches: int, checkpoint: str) -> MemoryPlan | None:
        split = plan.split_backwards
        try:     # None where the schedule cannot serve it (interleaved's M, a V's M >= 2K, ...)
            return planner.plan(k, micro_batches, checkpoint, schedule=plan.schedule,
                                split_backwards=None if split is None else min(split, micro_batches))
        except ValueError:
            return None
    out: list[str] = []
    # more re-materialization, least first: except_last keeps the last micro-batch's activations,
    # which under 1F1B is about all that never keeps at the peak
    lighter = list(REMATERIALIZATION[REMATERIALIZATION.index(ckpt) + 1:])
    tried = [(c, p) for c in lighter if (p := planned(cells, m, c)) is not None]
    if tried:
        c, p = next(((c, p) for c, p in tried if p.fits(budget)), min(tried, key=lambda t: t[1].max_peak))
        out.append(f"re-materialization (--checkpoint {c}): {_gib(p.max_peak)} per device"
                   + (" - fits" if p.fits(budget) else " - still too much"))
    m2 = m * 2
    while m2 <= planner.batch:
        found = next(((c, p) for c in [ckpt, *lighter]
                      if (p := planned(cells, m2, c)) is not None and p.fits(budget)), None)
        if found is not None:
            c, p = found
            also = "" if c == ckpt else f" with --checkpoint {c}"
            out.append(f"more micro-batches: M={m2}{also} fits ({_gib(p.max_peak)} per device)")
            break
        m2 *= 2
    else:
        out.append(f"more micro-batches does not fit, with any re-materialization (M up to the batch, "
                   f"{planner.batch})")
    limit = min(planner.num_layers, max_partitions or planner.num_layers)
    k2 = cells * 2
    while k2 <= limit:
        p = planned(k2, m, ckpt)
        if p is not None and p.fits(budget):
            devices = "" if per == 1 else f" on {k2 // per} devices"
            out.append(f"more devices: K={k2}{devices} fits ({_gib(p.max_peak)} per device)")
            break
        k2 *= 2
    else:
        out.append(f"more devices alone does not fit (up to K={limit})")
    out.append(f"or devices with at least {_gib(plan.max_peak)} each")
    return out


__all__ = ["why", "what_would_fit"]
