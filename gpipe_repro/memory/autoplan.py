"""Choosing K, M and the partition: the fastest configuration that fits a per-device budget.

For every K (powers of two up to the devices available) and M (powers of two up to the batch),
with and without re-materialization, and for every schedule asked for (those that apply to K, M):

1. cut the layers with the partitioner's bottleneck objective on compute time (FLOPs / device rate,
   a re-materialized forward counted twice), *capped* by the per-layer memory estimate
   (``partition(..., memory=..., memory_cap=...)``); if the exact plan of that cut still overflows,
   lower the cap by the overshoot and cut again (a few times); if no cut meets the cap at all (the
   estimate holds every micro-batch, as fill-drain does), cut on time alone and let the plan decide;
2. plan its memory exactly (:class:`~gpipe_repro.memory.planner.MemoryPlanner`);
3. if it fits, simulate one step (:func:`gpipe_repro.sim.simulator.simulate`: the schedule's actions
   with per-stage compute times and the link model) for its throughput.

Interleaved 1F1B cuts 2K cells, two per device (cell c on device c mod K); a device's peak is its
two cells' actions walked together in its process's order (:func:`gpipe_repro.memory.compose.walk_device`).

The answer is the fitting configuration with the highest simulated throughput. All numbers are
simulated; the time model is compute-bound (FLOPs at a fixed rate), so it ranks configurations by
bubble, imbalance, re-computation and communication, not by kernel efficiency.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpipe_repro.engine.partition import partition
from gpipe_repro.engine.schedule import SCHEDULES, Schedule, cells_per_process, make_schedule
from gpipe_repro.memory.compose import boundary_bytes, boundary_grad_bytes
from gpipe_repro.memory.planner import MemoryPlan, MemoryPlanner, gib_apart
from gpipe_repro.sim.links import LinkModel
from gpipe_repro.sim.simulator import PipelineCosts, Simulation, simulate
from gpipe_repro.sim.tied import cell_ties, with_tied_allreduce


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


def simulate_step(planner: MemoryPlanner, sched: Schedule, balance: Sequence[int], micro_batches: int,
                  flops_per_second: float, link: LinkModel) -> Simulation:
    """One simulated step of `sched` over the planner's FLOP costs, with the all-reduce of every
    parameter tied across cells (tied embeddings) charged at AGREE."""
    sim = simulate(sched, _costs(planner, balance, micro_batches, flops_per_second), link, planner.batch)
    return with_tied_allreduce(sim, sched, cell_ties(planner.ties, balance), link)


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
            # zero-bubble split: the input gradient's share (sim.calibration.costs.input_share's rule)
            bwd_input[s].append(sum(p.bwd_flops * (0.5 if p.param_bytes else 1.0) for p in cell)
                                / flops_per_second)
            sent[s].append(float(boundary_bytes(cell[-1].out_sig)))
            back[s].append(float(boundary_grad_bytes(cell[-1].out_sig)))
    profs = planner.profiles(sizes[0], flops=True)
    # RMSProp: a handful of FLOPs per parameter (4-byte fp32 parameters).
    opt = [sum(p.param_bytes for p in profs[a:a + k]) / 4 * 6 / flops_per_second
           for a, k in zip(starts, balance)]
    return PipelineCosts(fwd, fwd, fwd, bwd, opt, sent, back, backward_input=bwd_input)


def not_applicable(schedule: str, partitions: int, micro_batches: int, num_layers: int) -> str:
    """Why `schedule` cannot serve K=`partitions`, M=`micro_batches` on `num_layers` layers ("" if it
    can). On one device every schedule runs gpipe's actions, so only gpipe is a candidate there."""
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r} (choose from {', '.join(sorted(SCHEDULES))})"
    if partitions == 1 and schedule != "gpipe":
        return "on one device every schedule is gpipe's"
    per = cells_per_process(schedule)
    if per > 1 and per * partitions > num_layers:
        return f"{per}K={per * partitions} cells but only {num_layers} layers"
    try:         # the schedule's own rules (interleaved's M a multiple of K, DualPipeV's M >= 2K, ...)
        make_schedule(schedule, per * partitions, micro_batches, "never")
    except ValueError as e:
        return str(e).split(";")[0]
    return ""


def device_counts(max_devices: int) -> list[int]:
    """The K a search tries: the powers of two up to `max_devices`, and `max_devices` itself."""
    return sorted(set(_powers(max_devices)) | {max_devices})


def why_none_applies(max_devices: int, micro_batches: Sequence[int], schedules: Sequence[str],
                     num_layers: int) -> list[str]:
    """Where a search has no candidate at all: each schedule's reasons over the (K, M) it tried
    (:func:`device_counts`, `micro_batches`), one line per schedule and reason."""
    reasons: dict[str, list[str]] = {}
    for name in schedules:
        for k in device_counts(max_devices):
            for m in micro_batches:
                why = not_applicable(name, k, m, num_layers)
                if why and _skip(name, k, m, num_layers, several=len(schedules) > 1):
                    reasons.setdefault(f"{name}: {why}", []).append(f"K={k} M={m}")
    return [f"{reason} ({', '.join(where)})" for reason, where in reasons.items()]


def _skip(schedule: str, partitions: int, micro_batches: int, num_layers: int, *, several: bool) -> bool:
    why = not_applicable(schedule, partitions, micro_batches, num_layers)
    # Asked for one schedule only, K=1 is still a candidate (it runs gpipe's actions under its name).
    return bool(why) and (several or partitions > 1 or cells_per_process(schedule) > 1)


def evaluate(planner: MemoryPlanner, partitions: int, micro_batches: int, checkpoint: str,
             budget: float, link: LinkModel, flops_per_second: float, schedule: str = "gpipe",
             attempts: int = 4) -> Candidate:
    """One (K, M, checkpoint, schedule): a memory-capped cut, its plan and, if it fits, its
    throughput. Interleaved cuts 2K cells and a device's peak is its two cells' walked together."""
    cand = Candidate(partitions, micro_batches, checkpoint, schedule=schedule)
    cells = partitions * cells_per_process(schedule)
    per_device = cells // partitions
    if cells > planner.num_layers or micro_batches > planner.batch:
        cand.note = "more devices than layers" if cells > planner.num_layers else "M > batch"
        return cand
    flops = planner.layer_flops(micro_batches)
    replay = 2.0 if checkpoint != "never" else 1.0
    work = [micro_batches * (replay * f + b) for f, b in flops]
    memory = planner.layer_memory(micro_batches, checkpoint)
    cap = budget / per_device
    plan = None
    for _ in range(attempts):
        try:
            balance = (partition(work, cells, "bottleneck", memory=memory, memory_cap=cap)
                       if cells > 1 else [planner.num_layers])
        except ValueError as e:
            if plan is not None:
                cand.note = str(e)
                break
            # The per-layer estimate holds every micro-batch (fill-drain's worst case), so it can
            # rule out a cut that 1F1B, ZB-H1 or interleaved fit: cut on time alone and let the
            # exact plan decide.
            balance = partition(work, cells, "bottleneck")
        plan = planner.plan(cells, micro_batches, checkpoint, balance=balance, schedule=schedule)
        cand.balance, cand.plan = balance, plan
        cand.max_peak = plan.max_peak
        if cand.max_peak <= budget or cells == 1:
            break
        cap -= (cand.max_peak - budget) / per_device
        if cap <= 0:      # what stays on a device whatever its layers (weights, state) overflows
            need, have = gib_apart(cand.max_peak, budget)
            cand.note = f"does not fit: the largest device needs {need} GiB of {have}"
            break
    if cells > 1 and (plan is None or cand.max_peak > budget):
        # the cut with the smallest largest peak (what `fit` plans without --balance): time-capped
        # cuts can miss one that fits (a LLaMA at K=4 M=8: 0.338 GiB where fit's cut took 0.279)
        lowest = planner.plan(cells, micro_batches, checkpoint, schedule=schedule, budget=budget)
        if lowest.max_peak <= budget or plan is None or lowest.max_peak < cand.max_peak:
            cand.balance, cand.plan, cand.max_peak = list(lowest.balance), lowest, lowest.max_peak
            plan = lowest
            if cand.max_peak <= budget:
                cand.note = ""
    if plan is None or cand.max_peak > budget:
        cand.note = cand.note or "does not fit"
        return cand
    sched = make_schedule(schedule, cells, micro_batches, checkpoint)
    sim = simulate_step(planner, sched, cand.balance, micro_batches, flops_per_second, link)
    cand.fits, cand.throughput, cand.step_time = True, sim.throughput, sim.step_time
    cand.bubble = sim.bubble_fraction
    return cand


def micro_batch_candidates(planner: MemoryPlanner, given: Sequence[int] | None,
                           left_out: dict[int, str] | None = None) -> list[int]:
    """The M candidates to plan: `given` (each must run: a LayerNotTraceable names the M), else the
    powers of two up to the batch that the model's layers can train on; those they cannot (a
    micro-batch of one example, which a BatchNorm after global pooling refuses in training) are
    left out, with why, into `left_out`. A model that runs at none of them raises the first one's
    error (a layer that cannot be planned at all)."""
    from gpipe_repro.memory.profile import LayerNotTraceable

    kept, failed = [], []
    for m in (list(given) if given else _powers(planner.batch)):
        try:
            for size in set(planner.sizes(m)):
                planner.profiles(size)
        except LayerNotTraceable as e:
            rows = planner.batch // m
            why = f"M={m} (micro-batches of {rows} example{'' if rows == 1 else 's'}): {e}"
            if given:
                raise LayerNotTraceable(f"{why}; give --m candidates that leave more per micro-batch") from e
            failed.append((m, why, e))
            continue
        kept.append(m)
    if failed and not kept:
        raise failed[0][2]
    if left_out is not None:
        left_out.update((m, why) for m, why, _ in failed)
    return kept


def search(planner: MemoryPlanner, max_devices: int, budget: float, link: LinkModel,
           flops_per_second: float, micro_batches: Sequence[int] | None = None,
           checkpoints: Sequence[str] = ("except_last", "never"),
           schedule: str = "gpipe", schedules: Sequence[str] | None = None,
           left_out: dict[int, str] | None = None) -> list[Candidate]:
    """Every candidate, the fastest fitting one first. With `schedules` (e.g.
    ``sorted(engine.schedule.SCHEDULES)``) every schedule that applies to a (K, M)
    (:func:`not_applicable`) is a candidate too, each with its own memory plan and simulated step,
    so the answer chooses the schedule; otherwise `schedule` only. The M candidates are
    :func:`micro_batch_candidates`' (`left_out` gets the default ones the model cannot run)."""
    ks = device_counts(max_devices)
    ms = micro_batch_candidates(planner, micro_batches, left_out)
    names = list(schedules) if schedules else [schedule]
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedule(s) {', '.join(unknown)}: choose from "
                         f"{', '.join(sorted(SCHEDULES))}")
    cands = [evaluate(planner, k, m, c, budget, link, flops_per_second, name)
             for k in ks for m in ms for c in checkpoints for name in names
             if not _skip(name, k, m, planner.num_layers, several=len(names) > 1)]
    return sorted(cands, key=lambda c: (not c.fits, -c.throughput, c.max_peak))


def schedule_verdict(cands: Sequence[Candidate], schedules: Sequence[str], budget: float) -> list[str]:
    """Why the chosen schedule: one line per schedule, its best fitting candidate against the chosen
    one (throughput and largest device peak), or why it has none. `cands` as :func:`search` returns
    them (fastest fitting first)."""
    gib = float(1 << 30)
    best = cands[0] if cands and cands[0].fits else None

    def where(c: Candidate) -> str:
        return f"K={c.partitions}, M={c.micro_batches}, {c.checkpoint}"

    lines = []
    for name in schedules:
        mine = [c for c in cands if c.schedule == name]
        top = next((c for c in mine if c.fits), None)
        if top is None:
            smallest = min((c.max_peak for c in mine if c.max_peak), default=0)
            lines.append(f"{name}: " + ("applies to none of the K, M tried" if not mine else
                                        f"nothing fits in {budget / gib:.3g} GiB" +
                                        (f" (smallest device peak {smallest / gib:.3g} GiB)" if smallest
                                         else " (no cut meets the memory cap)")))
        elif best is not None and top is best:
            lines.append(f"{name}: chosen, {top.throughput:.1f} samples/s ({where(top)}), largest "
                         f"device peak {top.max_peak / gib:.3g} GiB")
        elif best is not None:
            slower = 1 - top.throughput / best.throughput
            memory = ("less memory than" if top.max_peak < best.max_peak else
                      "more memory than" if top.max_peak > best.max_peak else "as much memory as")
            lines.append(f"{name}: at best {top.throughput:.1f} samples/s ({where(top)}), {slower:.1%} "
                         f"slower, largest device peak {top.max_peak / gib:.3g} GiB ({memory} the "
                         "choice)")
    return lines


__all__ = ["Candidate", "device_counts", "evaluate", "not_applicable", "schedule_verdict", "search",
           "why_none_applies"]
