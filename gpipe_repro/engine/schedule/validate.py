"""Checking a schedule before anything runs it: every action well placed on its stage
(:func:`validate`), the process programs consistent with the stages, the whole free of deadlock
(by running it in unit time through :mod:`gpipe_repro.engine.interpreter`), and, for backends that
match messages in order, the link order (:func:`check_link_order`)."""
from __future__ import annotations

from collections import Counter, defaultdict

from gpipe_repro.engine.schedule.actions import (
    _SHORT,
    BACKWARDS,
    RECVS,
    SENDS,
    Action,
    ActionKind,
    ScheduleError,
)
from gpipe_repro.engine.schedule.core import Schedule

__all__ = ["validate", "check_link_order"]


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every action is well placed and the whole runs to completion."""
    k, m_count = schedule.num_stages, schedule.num_microbatches
    if len(schedule.stages) != k:
        raise ScheduleError(f"{len(schedule.stages)} action lists for {k} stages")
    for s, actions in enumerate(schedule.stages):
        try:
            _validate_stage(s, k, m_count, actions, schedule.training)
        except ScheduleError as e:
            if e.schedule is None:
                raise ScheduleError(e.message, schedule, e.at) from None
            raise
    if schedule.processes is not None:
        _validate_processes(schedule)
    from gpipe_repro.engine.interpreter import run_dataflow  # one executor of the dataflow semantics
    run_dataflow(schedule, duration=lambda a: 1.0)


def _validate_processes(schedule: Schedule) -> None:
    assert schedule.processes is not None
    where: dict[int, set[int]] = defaultdict(set)
    for p, actions in enumerate(schedule.processes):
        for a in actions:
            where[a.stage].add(p)
    for s in range(schedule.num_stages):
        if len(where[s]) != 1:
            raise ScheduleError(f"stage {s}'s actions are on processes {sorted(where[s])}: a stage "
                                "runs on exactly one process", schedule, list(schedule.stages[s][:1]))
        mine = tuple(a for a in schedule.processes[next(iter(where[s]))] if a.stage == s)
        if mine != schedule.stages[s]:
            raise ScheduleError(f"the process programs do not hold stage {s}'s actions in its order",
                                schedule, list(schedule.stages[s][:1]))


def check_link_order(schedule: Schedule) -> None:
    """Raise ScheduleError unless every stage sends to a neighbour in the order the neighbour
    receives. Backends that match point-to-point messages in order (NCCL ignores tags) need it;
    the dataflow semantics (:mod:`gpipe_repro.engine.interpreter`) do not."""
    sends: dict[tuple[int, int], list[Action]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for actions in schedule.stages:
        for a in actions:
            if a.kind in SENDS:
                sends[(a.stage, a.peer().stage)].append(a.peer())
            elif a.kind in RECVS:
                recvs[(a.peer().stage, a.stage)].append(a)
    for (src, dst), order in sends.items():
        got = recvs[(src, dst)]
        if order != got:
            i = next((i for i, (x, y) in enumerate(zip(order, got)) if x != y), min(len(order), len(got)))
            at = [a for a in (order[i:i + 1] + got[i:i + 1])] + [a.peer() for a in order[i:i + 1]]
            raise ScheduleError(f"schedule {schedule.name!r}: stage {src} sends to stage {dst} in a "
                                "different order than it receives; a backend that matches messages "
                                "in order (NCCL) would mismatch them", schedule, at)


def _validate_stage(s: int, k: int, m_count: int, actions: tuple[Action, ...], training: bool) -> None:
    where = f"stage {s}"
    for a in actions:
        if a.stage != s:
            raise ScheduleError(f"{where} holds {a} of stage {a.stage}", at=[a])
        if a.kind not in (ActionKind.OPTIMIZER_STEP, ActionKind.AGREE) and not (
                a.microbatch is not None and 0 <= a.microbatch < m_count):
            raise ScheduleError(f"{where}: {a} names micro-batch {a.microbatch} outside 0..{m_count - 1}",
                                at=[a])
    counts = Counter((a.kind, a.microbatch) for a in actions)
    dup = [f"{_SHORT[kind]}{mb}" for (kind, mb), c in counts.items() if c > 1]
    if dup:
        raise ScheduleError(f"{where}: actions repeated: {dup}",
                            at=[a for a in actions if counts[(a.kind, a.microbatch)] > 1])
    split = {mb for mb in range(m_count)
             if (ActionKind.BACKWARD_INPUT, mb) in counts or (ActionKind.BACKWARD_WEIGHT, mb) in counts}
    for mb in sorted(split):
        if (ActionKind.BACKWARD, mb) in counts:
            raise ScheduleError(f"{where}: micro-batch {mb} has both a BACKWARD (B) and a split backward "
                                "(I/W): use one or the other", at=[a for a in actions if a.microbatch == mb
                                                                   and a.kind in BACKWARDS])
        for kind in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT):
            if (kind, mb) not in counts:
                raise ScheduleError(f"{where}: {Action(kind, s, mb)} is missing: a split backward needs "
                                    "both its input-gradient (I) and weight-gradient (W) halves",
                                    at=[Action(kind, s, mb)])
    expected = {ActionKind.FORWARD: True, ActionKind.RECV_ACT: s > 0, ActionKind.SEND_ACT: s < k - 1,
                ActionKind.BACKWARD: training, ActionKind.RECV_GRAD: training and s < k - 1,
                ActionKind.SEND_GRAD: training and s > 0}
    for kind, wanted in expected.items():
        for mb in range(m_count):
            if kind is ActionKind.BACKWARD and mb in split:
                if not training:
                    raise ScheduleError(f"{where}: a forward-only schedule cannot have backward actions",
                                        at=[a for a in actions if a.microbatch == mb and a.kind in BACKWARDS])
                continue   # checked above: I and W stand for B
            if ((kind, mb) in counts) != wanted:
                state = "missing" if wanted else "not allowed"
                raise ScheduleError(f"{where}: {Action(kind, s, mb)} is {state}",
                                    at=[Action(kind, s, mb)])
    no_training = (ActionKind.RECOMPUTE, ActionKind.OPTIMIZER_STEP, ActionKind.AGREE)
    if not training and any(a.kind in no_training for a in actions):
        raise ScheduleError(f"{where}: a forward-only schedule cannot recompute or update (or agree)", at=[
            a for a in actions if a.kind in no_training])
    if training and counts[(ActionKind.OPTIMIZER_STEP, None)] != 1:
        raise ScheduleError(f"{where}: needs exactly one optimizer step")
    pos = {(a.kind, a.microbatch): i for i, a in enumerate(actions)}
    before = [(ActionKind.RECV_ACT, ActionKind.FORWARD), (ActionKind.FORWARD, ActionKind.SEND_ACT),
              (ActionKind.FORWARD, ActionKind.RECOMPUTE), (ActionKind.RECOMPUTE, ActionKind.BACKWARD),
              (ActionKind.FORWARD, ActionKind.BACKWARD), (ActionKind.RECV_GRAD, ActionKind.BACKWARD),
              (ActionKind.BACKWARD, ActionKind.SEND_GRAD),
              # the split backward: W after its I (Qi et al. 2024); I plays B's part for the rest
              (ActionKind.RECOMPUTE, ActionKind.BACKWARD_INPUT),
              (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT),
              (ActionKind.RECV_GRAD, ActionKind.BACKWARD_INPUT),
              (ActionKind.BACKWARD_INPUT, ActionKind.SEND_GRAD),
              (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)]
    for mb in range(m_count):
        for first, then in before:
            i, j = pos.get((first, mb)), pos.get((then, mb))
            if i is not None and j is not None and i > j:
                raise ScheduleError(f"{where}: {Action(then, s, mb)} comes before {Action(first, s, mb)}",
                                    at=[Action(then, s, mb), Action(first, s, mb)])
        for kind in BACKWARDS:
            if (kind, mb) in pos and pos[(kind, mb)] > min(pos.get((ActionKind.OPTIMIZER_STEP, None), len(
                    actions)), pos.get((ActionKind.AGREE, None), len(actions))):
                raise ScheduleError(f"{where}: {Action(kind, s, mb)} after the AGREE / optimizer step: every "
                                    "gradient (W included) must be final before the stages agree",
                                    at=[Action(kind, s, mb)])
    if training:   # after the checks above, so that their more specific errors come first
        agree = Action(ActionKind.AGREE, s)
        if agree not in actions:
            raise ScheduleError(f"{where}: {agree} is missing: every training stage ends with AGREE (A) "
                                "then its optimizer step (U)", at=[agree])
        if actions[-2:] != (agree, Action(ActionKind.OPTIMIZER_STEP, s)):
            raise ScheduleError(f"{where}: must end with AGREE (A) then the optimizer step (U): every "
                                "action of the step comes before the barrier, the update after it",
                                at=[agree])

