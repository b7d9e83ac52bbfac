"""The one stage-driver loop: walking the processes' programs with the AGREE barrier rule.

Every executor of a :class:`~gpipe_repro.engine.schedule.Schedule` walks the same thing,
``schedule.programs()`` (one ordered action list per process), by the same rule:

- round robin over the processes; each runs its next actions in order until one cannot run yet
  (``ready`` says no: a receive whose value has not arrived) or it reaches a barrier (AGREE), or,
  when ``yield_after`` says so, right after that action (so stages take turns one compute action at
  a time);
- a barrier is released only when EVERY process waits at one; then ``barrier`` runs those actions
  together (the interpreter ends them at the latest arrival, the local runtime sums the stages'
  AGREE vectors first, the distributed runtime does its one all-reduce) and every process moves on;
- a round in which no process can move means the schedule cannot finish: ``stuck`` names the
  blocked actions and its exception is raised, instead of hanging.

Who uses it: :func:`gpipe_repro.engine.interpreter.run_dataflow` (virtual time: validation,
rendering, simulation), :func:`gpipe_repro.engine.local_runtime.run_local` (every stage in one
process) and the distributed runtime's per-rank loop (its own process's program only: a receive
blocks inside ``run`` and the barrier is the all-reduce, so ``ready`` is always true there).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from gpipe_repro.engine.schedule import BARRIERS, Action

__all__ = ["drive"]


def _always(process: int, action: Action) -> bool:
    return True


def _never(process: int, action: Action) -> bool:
    return False


def drive(programs: Sequence[Sequence[Action]], *, run: Callable[[int, Action], None],
          barrier: Callable[[list[tuple[int, Action]]], None],
          stuck: Callable[[list[Action]], Exception],
          ready: Callable[[int, Action], bool] = _always,
          yield_after: Callable[[int, Action], bool] = _never) -> None:
    """Run `programs` (one action list per process) to completion by the rule of the module docstring.

    Args:
        programs: each process's actions in its order (``Schedule.programs()``).
        run: ``run(process, action)`` executes one non-barrier action.
        barrier: ``barrier([(process, action), ...])`` executes the barrier action every process is
            waiting at (one per process, in process order); called only when all of them wait.
        stuck: builds the exception raised when no process can move, from the blocked actions.
        ready: ``ready(process, action)``: whether a non-barrier action can run now (default: always).
        yield_after: ``yield_after(process, action)``: whether to pass to the next process right after
            running this action (default: never; each process runs as far as it can).
    """
    pcs = [0] * len(programs)
    ends = [len(p) for p in programs]
    remaining = sum(ends)
    while remaining:
        progressed = False
        waiting = 0          # processes whose next action is a barrier, after their turn this round
        for p, actions in enumerate(programs):
            pc, end = pcs[p], ends[p]
            while pc < end:
                a = actions[pc]
                if a.kind in BARRIERS or not ready(p, a):
                    break
                run(p, a)
                pc += 1
                remaining -= 1
                progressed = True
                if yield_after(p, a):
                    break
            pcs[p] = pc
            if pc < end and actions[pc].kind in BARRIERS:
                waiting += 1
        if waiting == len(programs):
            barrier([(p, actions[pcs[p]]) for p, actions in enumerate(programs)])
            for p in range(len(programs)):
                pcs[p] += 1
            remaining -= len(programs)
            progressed = True
        if not progressed:
            raise stuck([actions[pcs[p]] for p, actions in enumerate(programs) if pcs[p] < len(actions)])
