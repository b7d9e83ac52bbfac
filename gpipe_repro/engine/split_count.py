"""``GPipe(split_backwards="auto")``: how many of its last micro-batches a zero-bubble schedule splits,
and its cut, from each layer's measured costs.

The split pays where a weight gradient fills idle time and costs where it does not
(:mod:`gpipe_repro.engine.schedule.partial_split`). With each layer's forward, whole backward and
split backward timed on the sample (:func:`gpipe_repro.engine.layer_costs.measure_split_costs`; the
split's figure holds what the split forward costs over a plain one), every split count 0..M runs in
virtual time through the interpreter that validates schedules (links free: the engine does not know
its link; the harness's simulator does, :mod:`gpipe_repro.sim.split_choice`), on two cuts: the one
balancing the split's costs and the one balancing whole backwards. The shortest step wins; a step
within :data:`TIE` of it with fewer splits wins over it (less held from I to W).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.interpreter import run_dataflow
from gpipe_repro.engine.layer_costs import Loss, measure_split_costs, split_and_whole
from gpipe_repro.engine.partition import partition
from gpipe_repro.engine.schedule import Action, ActionKind, Schedule, make_schedule

__all__ = ["TIE", "Steps", "fewest_splits", "steps_by_count", "choose_split_count", "cut_and_split"]

#: Relative difference below which two steps tie (the fewer splits win).
TIE = 1e-3

#: Seconds of a step per candidate (cut, split count).
Steps = dict[tuple[tuple[int, ...], int], float]


def fewest_splits(steps: Mapping[tuple[Any, int], float], tie: float = TIE) -> tuple[Any, int]:
    """The (cut, split count) of `steps` (seconds per candidate) with the fewest splits among those
    within `tie` of the shortest, the shorter on equal counts."""
    best = min(steps.values())
    return min((key for key, t in steps.items() if t <= best * (1.0 + tie)),
               key=lambda key: (key[1], steps[key]))


def steps_by_count(schedule: str, num_microbatches: int, checkpoint: str, recompute_ahead: bool,
                   cuts: Sequence[Sequence[int]],
                   step: Callable[[Schedule, Sequence[int]], float]) -> Steps:
    """`step(schedule, cut)` seconds of the zero-bubble `schedule` splitting its last n micro-batches'
    backwards, for every cut of `cuts` and every count n = 0..M: the candidates both choosers weigh
    (this module's, in virtual time; :func:`gpipe_repro.sim.split_choice.choose_split`, simulated)."""
    return {(tuple(cut), n): step(make_schedule(schedule, len(cut), num_microbatches, checkpoint,
                                                recompute_ahead, n), cut)
            for cut in cuts for n in range(num_microbatches + 1)}


def choose_split_count(schedule: str, num_microbatches: int, checkpoint: str, recompute_ahead: bool,
                       timed: Sequence[tuple[float, float, float]],
                       cuts: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """The cut among `cuts` and split count of the zero-bubble `schedule` whose step in virtual time
    is shortest (module docstring). `timed`: per layer (forward, whole backward, split backward)
    seconds at the micro-batch size."""
    durations = {tuple(cut): _durations(timed, cut) for cut in cuts}

    def step(sched: Schedule, cut: Sequence[int]) -> float:
        return max(e.end for e in run_dataflow(sched, durations[tuple(cut)]))
    cut, n = fewest_splits(steps_by_count(schedule, num_microbatches, checkpoint, recompute_ahead, cuts,
                                          step))
    return list(cut), n


def _durations(timed: Sequence[tuple[float, float, float]], cut: Sequence[int]) -> Callable[[Action], float]:
    """Each action's seconds on `cut` from the layers' (forward, whole, split backward): I and W each
    half the split's figure; the first cell's I nothing and its W its whole backward (its input
    takes no gradient, as the stage executor runs it); a recompute a forward; messages free."""
    firsts = [sum(cut[:s]) for s in range(len(cut))]
    forward, whole, split = ([sum(t[j] for t in timed[f:f + n]) for f, n in zip(firsts, cut)]
                             for j in range(3))

    def duration(a: Action) -> float:
        s = a.stage
        if a.kind in (ActionKind.FORWARD, ActionKind.RECOMPUTE):
            return forward[s]
        if a.kind is ActionKind.BACKWARD:
            return whole[s]
        if a.kind is ActionKind.BACKWARD_INPUT:
            return 0.0 if s == 0 else split[s] / 2
        if a.kind is ActionKind.BACKWARD_WEIGHT:
            return whole[s] if s == 0 else split[s] / 2
        return 0.0
    return duration


def cut_and_split(layers: Sequence[nn.Module], partitions: int, schedule: str, num_microbatches: int,
                  checkpoint: str, recompute_ahead: bool, objective: str, sample: Any,
                  loss: Loss | None, balance: Sequence[int] | None,
                  device: torch.device | str = "cpu") -> tuple[list[int], int]:
    """``GPipe(split_backwards="auto")``'s cut (`balance` where given, else the better of the two
    cuts of the module docstring) and split count, from the layers timed on `sample` on `device`."""
    timed = measure_split_costs(layers, sample, device, loss=loss)
    if balance is not None:
        cuts = [list(balance)]
    else:
        split, whole = split_and_whole(timed)
        cuts = [partition(whole, partitions, objective)]
        if objective == "bottleneck":    # the first cell runs whole backwards, the others split
            cuts.append(partition(split, partitions, objective, first=whole))
    return choose_split_count(schedule, num_microbatches, checkpoint, recompute_ahead, timed, cuts)
