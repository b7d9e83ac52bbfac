"""Choosing K, M and the partition: the fastest configuration that fits a per-device budget.

For every K (powers of two up to the devices available) and M (powers of two up to the batch),
with and without re-materialization:

1. cut the layers with the partitioner's bottleneck objective on compute time (FLOPs / device rate,
   a re-materialized forward counted twice), *capped* by the per-layer memory estimate
   (``partition(..., memory=..., memory_cap=...)``); if the exact plan of that cut still overflows,
   lower the cap by the overshoot and cut again (a few times);
2. plan its memory exactly (:class:`~gpipe_repro.memory.planner.MemoryPlanner`);
3. if it fits, simulate one step (:func:`gpipe_repro.sim.simulator.simulate`: the schedule's actions
   with per-stage compute times and the link model) for its throughput.

The answer is the fitting configuration with the highest simulated throughput. All numbers are
simulated; the time model is compute-bound (FLOPs at a fixed rate), so it ranks configurations by
bubble, imbalance, re-computation and communication, not by kernel efficiency.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpipe_repro.engine.partition import partition
from gpipe_repro.engine.schedule import make_schedule
from gpipe_repro.memory.compose import boundary_bytes, boundary_grad_bytes
from gpipe_repro.memory.planner import MemoryPlan, MemoryPlanner
from gpipe_repro.sim.links import LinkModel
from gpipe_repro.sim.simulator import PipelineCosts, simulate


@dataclass
class Candidate:
    partitions: int
    micro_batches: int
    checkpoint: str
    balance: list[int] = field(default_factory=list)
    max_peak: int = 0
    fits: bool = False
    throughput: float = 0.0       # samples per second (simulated)
    step_time: float = 0.0
    bubble: float = 0.0
    note: str = ""
    plan: MemoryPlan | None = None
    schedule: str = "gpipe"


def _powers(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def _costs(planner: MemoryPlanner, balance: Sequence[int], micro_batches: int,
           flops_per_second: float) -> PipelineCosts:
    sizes = planner.sizes(micro_batches)
    starts = [sum(balance[:s]) for s in range(len(balance))]
    fwd: list[list[float]] = [[] for _ in balance]
    bwd: list[list[float]] = [[] for _ in balance]
    bwd_input: list[list[float]] = [[] for _ in balance]
    sent: list[list[float]] = [[] for _ in balance]
    back: list[list[float]] = [[] for _ in balance]
    for n in sizes:
        profs = planner.profiles(n, flops=True)
        for s, (a, k) in enumerate(zip(starts, balance)):
            cell = profs[a:a + k] + ([profs[-1]] if s == len(balance) - 1 else [])
            fwd[s].append(sum(p.fwd_flops for p in cell) / flops_per_second)
            bwd[s].append(sum(p.bwd_flops for p in cell) / flops_per_second)
            # zero-bubble split: the input gradient's share (sim.simulator.input_share's rule)
            bwd_input[s].append(sum(p.bwd_flops * (0.5 if p.param_bytes else 1.0) for p in cell)
                                / flops_per_second)
            sent[s].append(float(boundary_bytes(cell[-1].out_sig)))
            back[s].append(float(boundary_grad_bytes(cell[-1].out_sig)))
    profs = planner.profiles(sizes[0], flops=True)
    # RMSProp: a handful of FLOPs per parameter (4-byte fp32 parameters).
    opt = [sum(p.param_bytes for p in profs[a:a + k]) / 4 * 6 / flops_per_second
           for a, k in zip(starts, balance)]
    return PipelineCosts(fwd, fwd, fwd, bwd, opt, sent, back, backward_input=bwd_input)


def evaluate(planner: MemoryPlanner, partitions: int, micro_batches: int, checkpoint: str,
             budget: float, link: LinkModel, flops_per_second: float, schedule: str = "gpipe",
             attempts: int = 4) -> Candidate:
    """One (K, M, checkpoint): a memory-capped cut, its plan and, if it fits, its throughput."""
    cand = Candidate(partitions, micro_batches, checkpoint, schedule=schedule)
    if partitions > planner.num_layers or micro_batches > planner.batch:
        cand.note = "more devices than layers" if partitions > planner.num_layers else "M > batch"
        return cand
    flops = planner.layer_flops(micro_batches)
    replay = 2.0 if checkpoint != "never" else 1.0
    work = [micro_batches * (replay * f + b) for f, b in flops]
    memory = planner.layer_memory(micro_batches, checkpoint)
    cap = budget
    plan = None
    for _ in range(attempts):
        try:
            balance = (partition(work, partitions, "bottleneck", memory=memory, memory_cap=cap)
                       if partitions > 1 else [planner.num_layers])
        except ValueError as e:
            cand.note = str(e)
            break
        plan = planner.plan(partitions, micro_batches, checkpoint, balance=balance, schedule=schedule)
        cand.balance, cand.max_peak, cand.plan = balance, plan.max_peak, plan
        if plan.fits(budget) or partitions == 1:
            break
        cap -= plan.max_peak - budget
    if plan is None or not plan.fits(budget):
        cand.note = cand.note or "does not fit"
        return cand
    sched = make_schedule(schedule, partitions, micro_batches, checkpoint)
    sim = simulate(sched, _costs(planner, cand.balance, micro_batches, flops_per_second), link,
                   planner.batch)
    cand.fits, cand.throughput, cand.step_time = True, sim.throughput, sim.step_time
    cand.bubble = sim.bubble_fraction
    return cand


def search(planner: MemoryPlanner, max_devices: int, budget: float, link: LinkModel,
           flops_per_second: float, micro_batches: Sequence[int] | None = None,
           checkpoints: Sequence[str] = ("except_last", "never"),
           schedule: str = "gpipe", schedules: Sequence[str] | None = None) -> list[Candidate]:
    """Every candidate, the fastest fitting one first. With `schedules` (e.g.
    ``sorted(engine.schedule.SCHEDULES)``) every schedule is a candidate too, each with its own
    memory plan and simulated step, so the answer chooses the schedule; otherwise `schedule` only."""
    ks = sorted(set(_powers(max_devices)) | {max_devices})
    ms = list(micro_batches) if micro_batches else _powers(planner.batch)
    names = list(schedules) if schedules else [schedule]
    if "interleaved" in names:
        raise ValueError("the planner search cuts one cell per device; interleaved 1F1B runs two per "
                         "device: compare it with gpipe_repro.memory.schedule_ablation, and search "
                         "over gpipe, 1f1b and zb-h1 here")
    cands = [evaluate(planner, k, m, c, budget, link, flops_per_second, name)
             for k in ks for m in ms for c in checkpoints for name in names]
    return sorted(cands, key=lambda c: (not c.fits, -c.throughput, c.max_peak))


__all__ = ["Candidate", "evaluate", "search"]
