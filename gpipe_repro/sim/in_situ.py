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
the zero-bubble halves (a zero-bubble schedule's BACKWARD_INPUT and BACKWARD_WEIGHT are read
together as its backward), RECOMPUTE's and OPTIMIZER_STEP's their own.

With ``checkpoint="except_last"`` one micro-batch is the last one and is never re-materialized, so
the in-situ run re-materializes it (``"always"``): every action kind the measured pipeline runs is
then timed once. The correction needs one process per cell and a valid M = 1 schedule
(:data:`SCHEDULES`).
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpipe_repro.engine.microbatch import split_sizes
from gpipe_repro.engine.timeline import Timeline
from gpipe_repro.sim.calibration.costs import Calibration
from gpipe_repro.sim.links import LinkModel
from gpipe_repro.sim.simulator import PipelineCosts, simulate_config, stage_costs

#: Schedules the correction applies to: one process per cell, and M = 1 is a valid step.
SCHEDULES = ("gpipe", "1f1b", "zb-h1")

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


#: The timeline's action kinds each factor is read from.
READ_FROM: dict[str, tuple[str, ...]] = {
    "forward": ("forward",),
    "recompute": ("recompute",),
    "backward": ("backward", "backward_input", "backward_weight"),
    "optimizer_step": ("optimizer_step",),
}


def _kind_seconds(seconds: Mapping[tuple[int, str], float], stage: int, kind: str) -> float | None:
    """Seconds of factor `kind` at `stage` (its :data:`READ_FROM` kinds summed); None where none ran."""
    found = [seconds[(stage, k)] for k in READ_FROM[kind] if (stage, k) in seconds]
    return sum(found) if found else None


def factors(measured: Sequence[Timeline], simulated: Timeline) -> list[dict[str, float]]:
    """Per stage, measured / simulated seconds of each action kind of :data:`SCALED` (median over
    the measured steps); 1.0 where either side has none."""
    runs = [action_seconds(t) for t in measured]
    model = action_seconds(simulated)
    out: list[dict[str, float]] = []
    for s in range(simulated.num_stages):
        per_kind = {}
        for kind in SCALED:
            sim_s = _kind_seconds(model, s, kind) or 0.0
            real = [x for x in (_kind_seconds(r, s, kind) for r in runs) if x is not None]
            per_kind[kind] = statistics.median(real) / sim_s if sim_s > 0 and real else 1.0
        out.append(per_kind)
    return out


def level_factors(measured: Sequence[Timeline], simulated: Timeline) -> dict[str, float]:
    """The whole pipeline's :func:`factors`: per action kind of :data:`SCALED`, the measured seconds
    over the simulated seconds, each summed over every stage (median over the measured steps); 1.0
    where either side has none. One factor per kind for every layer of the model, where
    :func:`factors` gives one per stage for one cut."""
    stages = range(simulated.num_stages)
    model = action_seconds(simulated)
    runs = [action_seconds(t) for t in measured]
    out: dict[str, float] = {}
    for kind in SCALED:
        sim_s = sum(_kind_seconds(model, s, kind) or 0.0 for s in stages)
        real = [x for x in (sum(_kind_seconds(r, s, kind) or 0.0 for s in stages) for r in runs) if x > 0]
        out[kind] = statistics.median(real) / sim_s if sim_s > 0 and real else 1.0
    return out


def leveled(calibration: Calibration, size: int, per_kind: Mapping[str, float]) -> Calibration:
    """`calibration` with its timed costs at micro-batch `size` (and its optimizer call) multiplied
    by `per_kind` (:func:`level_factors`), kind by kind as :data:`SCALED` maps them: the layers'
    costs at the level the stage processes ran them."""
    costs = dict(calibration.costs)
    costs[size] = [dataclasses.replace(c, **{name: getattr(c, name) * per_kind[kind]
                                             for kind, names in SCALED.items() for name in names
                                             if getattr(c, name) is not None})
                   for c in calibration.at(size)]
    return dataclasses.replace(calibration, costs=costs,
                               optimizer_call=calibration.optimizer_call * per_kind["optimizer_step"])


def level(workload: Any, calibration: Calibration, size: int, k: int, link: LinkModel, *,
          objective: str = "bottleneck", micro_batches: int = 4) -> tuple[Calibration, dict[str, float]]:
    """`calibration` leveled (:func:`leveled`) by a short run of `workload` itself on `k` real stage
    processes right after it: its balanced gpipe cut, 3 steps of `micro_batches` micro-batches of
    `size` (re-materialized, so every action kind runs; several, so the stages compute at the same
    time as in a measured run); and the factors. It models what a stage process pays that the
    calibrating process did not (the host's speed at run time, its caches and allocator, the
    executor's own work), for every layer alike; not the schedule's bubbles, transfers or
    accumulation, which stay the simulator's."""
    from gpipe_repro.engine.schedule import make_schedule
    from gpipe_repro.sim.own_model import in_situ_run
    from gpipe_repro.sim.partition_choice import choose_cut

    balance = choose_cut(calibration, size, "always", make_schedule("gpipe", k, k, "always"), objective)
    timelines = in_situ_run(workload, balance, microbatch=size, checkpoint="always", schedule="gpipe",
                            threads=1, steps=3, micro_batches=micro_batches)
    one = simulate_config(calibration, balance, micro_batches, micro_batches * size, link,
                          checkpoint="always", schedule="gpipe")
    factors = level_factors(timelines, one.timeline)
    return leveled(calibration, size, factors), factors


def run_checkpoint(checkpoint: str, micro_batches: int = 1) -> str:
    """The re-materialization mode of an in-situ run of `micro_batches` for a pipeline run with
    `checkpoint` (at M = 1, except_last would re-materialize nothing)."""
    return "always" if checkpoint == "except_last" and micro_batches == 1 else checkpoint


def check(schedule: str, k: int, cores: int, device: str) -> None:
    """Raise ValueError, saying what to change, where the correction cannot run."""
    if device != "cpu":
        raise ValueError(f"the in-situ correction runs the stages as CPU processes (gloo); device "
                         f"{device!r}: use device='cpu' or leave in_situ off")
    if schedule not in SCHEDULES:
        raise ValueError(f"the in-situ correction needs one process per cell and an M=1 step; schedule "
                         f"{schedule!r} has neither: use one of {', '.join(SCHEDULES)} or leave in_situ off")
    if k > cores:
        raise ValueError(f"the in-situ correction runs K={k} stage processes on one core each, but this "
                         f"host has {cores} usable core(s): use k <= {cores} or leave in_situ off")


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
                      steps: int = 3, micro_batches: int = 1) -> list[Timeline]:
    """The timelines of `steps` training steps of `sample` in `micro_batches` micro-batches (one by
    default) on the real stages, re-materialized as :func:`run_checkpoint` says for `checkpoint`."""
    from gpipe_repro.distributed.measure import measure_pipeline
    run = measure_pipeline(build, balance, micro_batches, sample,
                           checkpoint=run_checkpoint(checkpoint, micro_batches),
                           schedule=schedule, loss_fn=loss_fn, steps=steps, warmup=1, threads=threads)
    return list(run.timelines)


def corrected_costs(calibration: Calibration, balance: Sequence[int], m: int, batch_size: int,
                    timelines: Sequence[Timeline], *, link: LinkModel, checkpoint: str, schedule: str,
                    setup: float = 0.0, teardown: float = 0.0, micro_batches: int = 1
                    ) -> tuple[PipelineCosts, list[dict[str, float]]]:
    """The stage costs of `m` micro-batches of `batch_size` examples scaled by the factors that the
    in-situ `timelines` (steps of `micro_batches` micro-batches of ``batch_size / m`` examples) give
    against the calibration's simulation of the same step; and those factors."""
    sizes = split_sizes(batch_size, m)
    one = simulate_config(calibration, balance, micro_batches, micro_batches * sizes[0], link,
                          checkpoint=run_checkpoint(checkpoint, micro_batches), schedule=schedule,
                          setup=setup, teardown=teardown)
    per_stage = factors(timelines, one.timeline)
    return scaled(stage_costs(calibration, balance, sizes, setup, teardown), per_stage), per_stage
