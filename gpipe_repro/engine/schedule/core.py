"""The :class:`Schedule`: each stage's ordered actions (and, when stages share processes, each
process's program). Its methods are thin: checking is :mod:`.validate`'s, the text form and the
picture are :mod:`.text`'s, running it is :mod:`gpipe_repro.engine.interpreter`'s."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpipe_repro.engine.schedule.actions import Action, ActionKind

__all__ = ["Schedule"]


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as data (see :mod:`gpipe_repro.engine.schedule`).

    Attributes:
        name: the generator's name ("gpipe", "1f1b", "zb-h1", "interleaved", "forward", ...).
        num_stages: the number of stages (cells); num_microbatches: M.
        stages: ``stages[s]`` is stage s's actions in the order it runs them.
        training: False for forward-only (inference) schedules.
        processes: when stages share processes (interleaved 1F1B: v stages per process), each
            process's program: its stages' actions in the order it runs them. None: one process per
            stage, running `stages`.
    """
    name: str
    num_stages: int
    num_microbatches: int
    stages: tuple[tuple[Action, ...], ...]
    training: bool = True
    processes: tuple[tuple[Action, ...], ...] | None = None

    def programs(self) -> tuple[tuple[Action, ...], ...]:
        """What each process runs, in order: :attr:`processes`, or one program per stage."""
        return self.processes if self.processes is not None else self.stages

    def process_of(self) -> list[int]:
        """The process running each stage."""
        if self.processes is None:
            return list(range(self.num_stages))
        owner = [0] * self.num_stages
        for p, actions in enumerate(self.processes):
            for a in actions:
                owner[a.stage] = p
        return owner

    @property
    def splits_backward(self) -> bool:
        """Whether some stage runs some backwards split into input and weight halves (zero bubble).
        Stage 0 runs each of them whole at its W (its input takes no gradient). How a cut counts
        the split is :attr:`cut_by_split_costs`'s (:func:`gpipe_repro.sim.partition_choice.choose_cut`)."""
        return any(a.kind is ActionKind.BACKWARD_INPUT for actions in self.stages for a in actions)

    @property
    def split_share(self) -> float:
        """The share of backwards on stages after the first that are split (I/W rather than B):
        1 for the zero-bubble schedules as their papers write them, less where
        :func:`~gpipe_repro.engine.schedule.partial_split.split_last` keeps some whole, 0 for the
        others."""
        kinds = [a.kind for actions in self.stages[1:] for a in actions
                 if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)]
        return sum(k is ActionKind.BACKWARD_INPUT for k in kinds) / len(kinds) if kinds else 0.0

    @property
    def cut_by_split_costs(self) -> bool:
        """Whether a cut of this schedule balances the split's costs (the first cell by whole
        backwards, the others by both halves): where most backwards split (:attr:`split_share`
        above one half); else whole backwards."""
        return self.split_share > 0.5

    def checkpointed(self, stage: int) -> frozenset[int]:
        """Micro-batches whose forward on `stage` is re-materialized (it has a RECOMPUTE)."""
        return frozenset(a.microbatch for a in self.stages[stage]
                         if a.kind is ActionKind.RECOMPUTE and a.microbatch is not None)

    def validate(self) -> None:
        """Raise ScheduleError unless every action is well placed and the whole runs to completion."""
        from gpipe_repro.engine.schedule.validate import validate
        validate(self)

    def check_link_order(self) -> None:
        """Raise ScheduleError unless every stage sends to a neighbour in the order the neighbour
        receives. Backends that match point-to-point messages in order (NCCL ignores tags) need it;
        the dataflow semantics (:mod:`gpipe_repro.engine.interpreter`) do not."""
        from gpipe_repro.engine.schedule.validate import check_link_order
        check_link_order(self)

    def render(self, duration: Callable[[Action], float] | None = None) -> str:
        """ASCII picture: one row per stage (per process when stages share processes), one column per
        unit of time, compute actions only."""
        from gpipe_repro.engine.schedule.text import render
        return render(self, duration)

    def to_text(self, mark: Iterable[Action] = ()) -> str:
        """The schedule in its text form (see :mod:`gpipe_repro.engine.schedule`); actions in `mark`
        are bracketed ``>>F3<<`` and their lines end with ``<-- ERROR``."""
        from gpipe_repro.engine.schedule.text import to_text
        return to_text(self, mark)

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Parse :meth:`to_text`'s form (blank lines and ``#`` comments are ignored). Raises
        ScheduleError naming the line for anything it cannot read; it does not validate (call
        :meth:`validate` for that), so broken schedules can be written down and checked."""
        from gpipe_repro.engine.schedule.text import from_text
        return from_text(text)
