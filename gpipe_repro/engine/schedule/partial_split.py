"""A zero-bubble schedule that splits only its last micro-batches' backwards.

Splitting a backward into I and W is what lets zero bubble fill 1F1B's cool-down, but a split is not
free: the split forward keeps each deferred layer's input and the split backward's two halves cost
more than one backward (Python around every deferred layer; on small layers here I + W is 1.2 whole
backwards and the split forward 1.1-1.3 plain ones). The W that fill the bubble are those of the
last micro-batches; a steady-state W only trades places with work that was there anyway. So
``split_last(schedule, n)`` keeps the split for the last `n` micro-batches and runs every other
micro-batch's backward whole, as a B where its I was (nothing waits on its W, which is dropped).
n = M is the schedule as its paper writes it; n = 0 has no split at all. Which n pays depends on the
costs: the harness chooses it by simulating every n from measured costs
(:func:`gpipe_repro.sim.split_choice.choose_split`); ``GPipe(split_backwards=n)`` runs it.
"""
from __future__ import annotations

from dataclasses import replace

from gpipe_repro.engine.schedule.actions import Action, ActionKind
from gpipe_repro.engine.schedule.core import Schedule

__all__ = ["split_last"]


def split_last(schedule: Schedule, count: int) -> Schedule:
    """`schedule` with only its last `count` micro-batches' backwards split (see the module
    docstring); `count` from 0 to M. A schedule that splits nothing is returned as it is."""
    m_count = schedule.num_microbatches
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= m_count:
        raise ValueError(f"split_backwards must be an integer from 0 to M = {m_count} (how many of "
                         f"the last micro-batches split their backward), got {count!r}")
    whole_below = m_count - count

    def program(actions: tuple[Action, ...]) -> tuple[Action, ...]:
        out = []
        for a in actions:
            if a.microbatch is not None and a.microbatch < whole_below:
                if a.kind is ActionKind.BACKWARD_INPUT:
                    out.append(Action(ActionKind.BACKWARD, a.stage, a.microbatch))
                    continue
                if a.kind is ActionKind.BACKWARD_WEIGHT:
                    continue
            out.append(a)
        return tuple(out)

    if count == m_count or not schedule.splits_backward:
        return schedule
    processes = (None if schedule.processes is None
                 else tuple(program(actions) for actions in schedule.processes))
    return replace(schedule, stages=tuple(program(actions) for actions in schedule.stages),
                   processes=processes)
