"""Stage costs corrected from a short in-situ run: the chosen partition trained for a few steps of
one micro-batch each on the real stage processes, just before the prediction is used.

Why: per-layer costs are timed earlier and elsewhere (one process, the layers in sequence, a busy
neighbour standing in for the other stages). A stage process differs in ways no per-layer timing
carries: its host's speed at the time it runs (on a shared VM, other tenants change it by 2x and more
between a calibration and a run, uniformly over every action), the stage's own mix of caches and
allocator state, the co-running stages' real load, and the re-materialization exactly as the
executor runs it. One micro-batch per step (M = 1) runs every action kind of the schedule once per
stage without a bubble to fill and without gradient accumulation, so it measures each action kind
at the micro-batch size where it will run; the simulator still supplies what the correction must not
absorb: the schedule's order and bubbles, the accumulation of later micro-batches, the transfers.

The correction is one factor per (stage, action kind): measured seconds over the calibration's
seconds for the same actions of the same M = 1 step (median over the in-situ steps). FORWARD's
factor scales the forward with and without a graph, BACKWARD's the backward, its accumulation and
the zero-bubble halves, RECOMPUTE's and OPTIMIZER_STEP's their own.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpipe_repro.engine.timeline import Timeline
from gpipe_repro.sim.simulator import PipelineCosts

#: Action kinds a factor is read for, and the cost fields each scales.
SCALED: dict[str, tuple[str, ...]] = {
    "forward": ("forward", "forward_nograd"),
    "recompute": ("recompute",),
    "backward": ("backward", "accumulate", "backward_input", "backward_weight"),
    "optimizer_step": ("optimizer",),
}


def action_seconds(timeline: Timeline) -> dict[tuple[int, str], float]:
    """Seconds per (stage, action kind) of one step."""
    out: dict[tuple[int, str], float] = {}
    for e in timeline.events:
        out[(e.stage, e.kind)] = out.get((e.stage, e.kind), 0.0) + e.duration
    return out


def factors(measured: Sequence[Timeline], simulated: Timeline) -> list[dict[str, float]]:
    """Per stage, measured / simulated seconds of each action kind of :data:`SCALED` (median over
    the measured steps); 1.0 where either side has none."""
    runs = [action_seconds(t) for t in measured]
    model = action_seconds(simulated)
    out: list[dict[str, float]] = []
    for s in range(simulated.num_stages):
        per_kind = {}
        for kind in SCALED:
            sim_s = model.get((s, kind), 0.0)
            real = [r[(s, kind)] for r in runs if (s, kind) in r]
            per_kind[kind] = statistics.median(real) / sim_s if sim_s > 0 and real else 1.0
        out.append(per_kind)
    return out


def scaled(costs: PipelineCosts, per_stage: Sequence[Mapping[str, float]]) -> PipelineCosts:
    """`costs` with every stage's action costs multiplied by its factors."""
    changes: dict[str, Any] = {}
    for kind, fields in SCALED.items():
        for name in fields:
            value = getattr(costs, name)
            if value is None:
                continue
            if name == "optimizer":
                changes[name] = [v * per_stage[s][kind] for s, v in enumerate(value)]
            else:
                changes[name] = [[v * per_stage[s][kind] for v in row] for s, row in enumerate(value)]
    return dataclasses.replace(costs, **changes)


def in_situ_timelines(build: Callable[[], Any], balance: Sequence[int], sample: tuple[Any, Any], *,
                      checkpoint: str, schedule: str, loss_fn: Any, threads: int,
                      steps: int = 3) -> list[Timeline]:
    """The timelines of `steps` training steps of one micro-batch (`sample`) on the real stages."""
    from gpipe_repro.distributed.measure import measure_pipeline
    run = measure_pipeline(build, balance, 1, sample, checkpoint=checkpoint, schedule=schedule,
                           loss_fn=loss_fn, steps=steps, warmup=1, threads=threads)
    return list(run.timelines)
