"""Judging a runtime from its recorded timeline rather than from wall time.

A wall-clock speedup on a shared host moves with the load: a healthy pipeline measured next to a busy
process looks broken, and a broken one can look healthy. What a timeline records does
not have that problem, because host load slows both sides of each comparison below alike:

- :func:`order_violations`: each stage ran its actions in the order a reference schedule gives;
- :func:`overlap_fraction`: pairs of actions that a fill-drain schedule runs at the same time on two
  stages (stage 1's forward of micro-batch m and stage 0's forward of m+1, for instance) did
  overlap in time, as a share of the shorter action of each pair;
- :func:`replay_ratio`: the measured makespan over the simulator's replay of the *same* measured
  action durations through the schedule (the replay knows nothing but the durations and the
  dependencies, so a runtime that loses overlap, or waits where the schedule does not, is slower
  than its replay whatever the speed of the host);
- :func:`recompute_ratios`: a RECOMPUTE runs one forward of its micro-batch again, building the graph
  (the paper's re-materialization), so it costs what a graph-keeping forward of the same stage costs;
- :func:`parallel_cores`: how many distinct cores the stage processes were allowed to use.

Each returns a number or a list of what went wrong; the thresholds live with the callers (the CI
test and the detector, `experiments/check_regression_detector.py`).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

from gpipe_repro.engine.schedule import Schedule
from gpipe_repro.engine.timeline import Event, Timeline
from gpipe_repro.sim.links import get_link
from gpipe_repro.sim.simulator import replay_costs, simulate

ActionKey = tuple[str, int | None]          # (kind, micro-batch)
Pair = tuple[tuple[int, Sequence[str], int], tuple[int, Sequence[str], int]]
"""((stage, kinds, micro-batch), (stage, kinds, micro-batch)): two groups of actions that run at the
same time (each group: the actions of those kinds on that stage for that micro-batch)."""


def order_violations(timeline: Timeline, expected: Sequence[Sequence[ActionKey]]) -> list[str]:
    """Where a stage's recorded actions (by start time) differ from `expected[stage]`, both restricted
    to the kinds both know (a runtime's own extra actions, such as a barrier before the update, and
    kinds a timeline does not record are left out). Empty when every stage ran the expected order."""
    recorded_kinds = {e.kind for e in timeline.events}
    expected_kinds = {a[0] for acts in expected for a in acts}
    out = []
    for s in range(timeline.num_stages):
        got = [(e.kind, e.microbatch) for e in timeline.stage_events(s) if e.kind in expected_kinds]
        want = [a for a in expected[s] if a[0] in recorded_kinds]
        if got != want:
            first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w),
                         min(len(got), len(want)))
            out.append(f"stage {s}: action {first} is {got[first] if first < len(got) else 'missing'},"
                       f" expected {want[first] if first < len(want) else 'nothing'} "
                       f"({len(got)} recorded, {len(want)} expected)")
    return out


def _group(timeline: Timeline, stage: int, kinds: Sequence[str], microbatch: int) -> list[Event]:
    evs = [e for e in timeline.stage_events(stage) if e.kind in kinds and e.microbatch == microbatch]
    if not evs:
        raise ValueError(f"no {'/'.join(kinds)} of micro-batch {microbatch} on stage {stage} "
                         "in the timeline")
    return evs


def overlap_fraction(timeline: Timeline, pairs: Sequence[Pair]) -> float:
    """Sum over `pairs` of the time both groups' actions ran at once, over the sum of the shorter
    group's busy time: 1 when every pair fully overlapped, 0 when none did (a serialized runtime)."""
    both = shorter = 0.0
    for (s1, k1, m1), (s2, k2, m2) in pairs:
        a, b = _group(timeline, s1, k1, m1), _group(timeline, s2, k2, m2)
        both += sum(max(0.0, min(x.end, y.end) - max(x.start, y.start)) for x in a for y in b)
        shorter += min(sum(x.duration for x in a), sum(y.duration for y in b))
    return both / shorter if shorter > 0 else 0.0


def replay_ratio(timeline: Timeline, schedule: Schedule, link: str = "ideal") -> float:
    """Measured makespan over the simulated replay of the timeline's own action durations through
    `schedule` (:func:`gpipe_repro.sim.simulator.replay_costs`, sends free on the `link` preset):
    about 1 for a runtime that waits only where the schedule's dependencies make it wait."""
    costs = replay_costs(timeline, timeline.makespan)
    replay = simulate(schedule, costs, get_link(link), 1)
    return timeline.makespan / replay.timeline.makespan


def recompute_ratios(timeline: Timeline) -> list[float]:
    """Per stage: the median RECOMPUTE duration over the median duration of the FORWARDs that kept
    their graph (the micro-batches that are not re-materialized, e.g. the last one under
    ``checkpoint="except_last"``). Both build the same graph of the same cell, so about 1. Stages
    with no recompute or no graph-keeping forward are left out."""
    out = []
    for s in range(timeline.num_stages):
        evs = timeline.stage_events(s)
        rec = [e.duration for e in evs if e.kind == "recompute"]
        recomputed = {e.microbatch for e in evs if e.kind == "recompute"}
        kept = [e.duration for e in evs if e.kind == "forward" and e.microbatch not in recomputed]
        if rec and kept and statistics.median(kept) > 0:
            out.append(statistics.median(rec) / statistics.median(kept))
    return out


def parallel_cores(rank_cpus: Sequence[Sequence[int]]) -> int:
    """How many distinct cores the stage processes, together, were allowed to run on."""
    return len({c for cpus in rank_cpus for c in cpus})


def events_of(timeline: Timeline, kind: str) -> list[Event]:
    """Every event of one kind, in start order."""
    return sorted((e for e in timeline.events if e.kind == kind), key=lambda e: e.start)
