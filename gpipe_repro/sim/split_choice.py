"""Which backwards a zero-bubble schedule should split, and its cut, chosen from measured costs.

The zero-bubble split pays where a weight gradient fills idle time, and costs where it does not
(:mod:`gpipe_repro.engine.schedule.partial_split`: the split forward and the two halves cost more
than a plain forward and one backward). The Zero Bubble paper's automatic scheduler places the W by
the profiled T_F, T_B, T_W; here the order is the paper's handcrafted one and the choice is how many
of the last micro-batches split (0 to M), by simulating each count with the very schedule the
runtime runs, on two cuts: the one balancing the split's costs (every backward split) and the one
balancing whole backwards (few split). The shortest simulated step wins; a tie goes to fewer splits
(less work kept from I to W): the rule of ``GPipe(split_backwards="auto")``
(:mod:`gpipe_repro.engine.split_count`), which chooses the same way from its own timings of the
layers, without a link model.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpipe_repro.engine.microbatch import split_sizes
from gpipe_repro.engine.schedule import SPLIT_SCHEDULES, Schedule, cells_per_process, make_schedule
from gpipe_repro.engine.split_count import TIE, Steps, fewest_splits, steps_by_count
from gpipe_repro.sim.calibration.costs import Calibration
from gpipe_repro.sim.links import LinkModel
from gpipe_repro.sim.partition_choice import choose_cut
from gpipe_repro.sim.simulator import simulate, stage_costs

__all__ = ["SplitChoice", "choose_split", "TIE"]


@dataclass(frozen=True)
class SplitChoice:
    """A zero-bubble configuration's cut and split count, with the simulated steps it was chosen
    from: ``steps[(tuple(balance), n)]`` seconds, for every candidate cut and count."""

    balance: list[int]
    split_backwards: int
    step_time: float
    steps: Steps

    def to_json(self) -> dict[str, object]:
        return {"balance": self.balance, "split_backwards": self.split_backwards,
                "step_time_s": self.step_time,
                "candidates": [{"balance": list(b), "split_backwards": n, "step_time_s": t}
                               for (b, n), t in sorted(self.steps.items())]}


def choose_split(calibration: Calibration, schedule: str, processes: int, num_microbatches: int,
                 microbatch: int, checkpoint: str, link: LinkModel, *, recompute_ahead: bool = False,
                 objective: str = "bottleneck", setup: float = 0.0,
                 teardown: float = 0.0) -> SplitChoice:
    """The cut and split count (:func:`gpipe_repro.engine.schedule.split_last`) of the zero-bubble
    `schedule` on `processes` processes, M = `num_microbatches` of `microbatch` rows, whose simulated
    step (exact costs, no jitter) is shortest (see the module docstring)."""
    if schedule not in SPLIT_SCHEDULES:
        raise ValueError(f"choose_split is for the zero-bubble schedules ({', '.join(SPLIT_SCHEDULES)}), "
                         f"got {schedule!r}")
    cells = processes * cells_per_process(schedule)
    m = num_microbatches
    cuts: list[list[int]] = []
    for share in (None, 0):     # every backward split; none: the cuts of the two cost models
        cut = choose_cut(calibration, microbatch, checkpoint,
                         make_schedule(schedule, cells, cells, checkpoint, split_backwards=share),
                         objective)
        if cut not in cuts:
            cuts.append(cut)
    batch = m * microbatch
    sizes = split_sizes(batch, m)

    costs = {tuple(cut): stage_costs(calibration, cut, sizes, setup, teardown) for cut in cuts}

    def step(sched: Schedule, cut: Sequence[int]) -> float:
        return simulate(sched, costs[tuple(cut)], link, batch).step_time
    steps = steps_by_count(schedule, m, checkpoint, recompute_ahead, cuts, step)
    balance, n = fewest_splits(steps, TIE)
    return SplitChoice(list(balance), n, steps[(balance, n)], steps)

