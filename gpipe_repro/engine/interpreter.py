"""Executing a schedule's dataflow semantics in virtual time.

One function, :func:`run_dataflow`, defines what it means to run a
:class:`~gpipe_repro.engine.schedule.Schedule`
when every action has a duration: each stage runs its actions in order, one at a time; a send costs
its own duration on the sender and then occupies the directed link for `transfer(action)` seconds
(transfers on one link go one after another); a receive blocks its stage until the matching transfer
has arrived; a barrier (AGREE) blocks every stage until all stages have reached theirs, and then
runs on all of them at once (it starts, for each, when it began waiting; it ends at the latest
arrival plus its duration). The walk itself is :func:`gpipe_repro.engine.driver.drive`'s, the same
loop the runtimes use; this module only says what each action costs. Nothing else is assumed, so
the same function serves three purposes:

- ``Schedule.validate()`` runs it with unit durations: if some stage can never proceed, the schedule
  would deadlock a real runtime, and it says which actions are stuck;
- ``Schedule.render()`` draws the resulting timeline as ASCII;
- the pipeline simulator (:mod:`gpipe_repro.sim.simulator`) feeds it measured durations and a link model.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpipe_repro.engine.driver import drive
from gpipe_repro.engine.schedule import RECVS, SENDS, Action, Schedule, ScheduleError

__all__ = ["SimEvent", "run_dataflow"]


@dataclass(frozen=True)
class SimEvent:
    action: Action
    start: float   # when the stage began the action (for a receive: when it began waiting)
    end: float     # when the stage was free again (for a receive: when the data had arrived)
    ready: float | None = None  # receives: when the data arrived (end = max(start, ready));
    #                             barriers: when the last stage reached the barrier


def run_dataflow(schedule: Schedule, duration: Callable[[Action], float],
                 transfer: Callable[[Action], float] | None = None) -> list[SimEvent]:
    """Run `schedule` in virtual time; return one event per action. Raises ScheduleError on deadlock.

    `duration(a)` is the time action `a` occupies its stage (sends and receives may cost time too:
    copies, serialization). `transfer(send_action)` is the time on the link from the send's end to the
    data's arrival (latency + bytes / bandwidth); 0 by default.
    """
    transfer = transfer or (lambda a: 0.0)
    clock = [0.0] * len(schedule.programs())   # one per process (= per stage unless stages share)
    arrived: dict[Action, float] = {}      # receive action -> time its data is available
    link_free: dict[tuple[int, int], float] = {}
    events: list[SimEvent] = []

    def run(p: int, a: Action) -> None:
        start = clock[p]
        if a.kind in RECVS:
            ready = arrived.pop(a)
            end = max(start, ready) + duration(a)
            events.append(SimEvent(a, start, end, ready))
        else:
            end = start + duration(a)
            events.append(SimEvent(a, start, end))
            if a.kind in SENDS:
                peer = a.peer()
                link = (a.stage, peer.stage)
                begin = max(end, link_free.get(link, 0.0))
                link_free[link] = begin + transfer(a)
                arrived[peer] = link_free[link]
        clock[p] = end

    def barrier(waiting: list[tuple[int, Action]]) -> None:
        ready = max(clock)
        for p, a in waiting:
            end = ready + duration(a)
            events.append(SimEvent(a, clock[p], end, ready))
            clock[p] = end

    def stuck(blocked: list[Action]) -> ScheduleError:
        names = [f"{a}@stage{a.stage}" for a in blocked]
        return ScheduleError(f"schedule {schedule.name!r} deadlocks: every unfinished stage waits on a "
                             f"receive whose send never comes or at a barrier another stage never reaches "
                             f"({', '.join(names)})", schedule, blocked)

    drive(schedule.programs(), run=run, barrier=barrier, stuck=stuck,
          ready=lambda p, a: a.kind not in RECVS or a in arrived)
    return events
