"""The all-reduce of a parameter tied across cells, charged on the simulated step.

What the distributed runtime does (:mod:`gpipe_repro.distributed.tied`): at the step's agreement
point each process holding a copy of a tied parameter adds up its own copies' gradients, then one
all-reduce per tie sums them over the processes holding it (a tie whose copies all sit on one
process, as zb-v's first and last cells, costs no collective). It runs when the last of those
processes reaches AGREE, one tie after another, and the step's AGREE cannot be released before it is
done. So::

    start_t   = max(arrival at AGREE of the processes holding tie t, end of the tie before it there)
    release   = max(max over processes of the arrival at AGREE, max over ties of start_t + A_t)
    step      = pipeline step + (release - max arrival)

``A_t`` is a ring all-reduce of the tie's bytes over its processes on the pipeline's own link (the
stages' point-to-point link: the pipeline's processes share a host, see
:mod:`gpipe_repro.distributed.groups`), :func:`gpipe_repro.sim.data_parallel.flat_allreduce`. With
replicas, each replica's tie groups are its own and run at the same time as the others'.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from gpipe_repro.engine.schedule import ActionKind, Schedule
from gpipe_repro.sim.data_parallel import CollectiveLink, flat_allreduce
from gpipe_repro.sim.links import LinkModel
from gpipe_repro.sim.simulator import Simulation

__all__ = ["TIED_EXPOSED", "cell_ties", "layer_ties", "tie_allreduce_time", "with_tied_allreduce"]

TIED_EXPOSED = "tied all-reduce (exposed)"   # the breakdown's category


def layer_ties(layers: Sequence[nn.Module]) -> list[tuple[float, list[int]]]:
    """Every parameter held by more than one layer of `layers` (a layer object may repeat, as a
    memory planner's run of identical layers does): its gradient's bytes and the positions holding
    it. Meta tensors do: only shapes and dtypes are read."""
    holders: dict[int, tuple[float, list[int]]] = {}
    for i, layer in enumerate(layers):
        for p in {id(p): p for p in layer.parameters()}.values():
            entry = holders.setdefault(id(p), (float(p.numel() * p.element_size()), []))
            entry[1].append(i)
    return [(nbytes, at) for nbytes, at in holders.values() if len(set(at)) > 1 and
            len({id(layers[i]) for i in at}) > 1]


def cell_ties(ties: Sequence[tuple[float, Sequence[int]]],
              balance: Sequence[int]) -> list[tuple[float, list[int]]]:
    """:func:`layer_ties` as the cut `balance` places them: each tie that spans several cells, with
    those cells (what :func:`with_tied_allreduce` takes)."""
    cell_of = [c for c, n in enumerate(balance) for _ in range(n)]
    spans = [(nbytes, sorted({cell_of[i] for i in at})) for nbytes, at in ties]
    return [(nbytes, cells) for nbytes, cells in spans if len(cells) > 1]


def tie_allreduce_time(nbytes: float, processes: int, link: LinkModel, algorithm: str = "ring") -> float:
    """Seconds to all-reduce a tied parameter's `nbytes` of gradient over `processes` on `link`."""
    return flat_allreduce(nbytes, processes, CollectiveLink(link.name, link.latency, link.bandwidth,
                                                            link.source), algorithm)


def with_tied_allreduce(sim: Simulation, schedule: Schedule, ties: Sequence[tuple[float, Sequence[int]]],
                        link: LinkModel, algorithm: str = "ring") -> Simulation:
    """`sim` (a step of `schedule`) with the all-reduce of each tie, given as (gradient bytes, the
    cells holding it), charged at AGREE (see the module docstring); the breakdown gains
    :data:`TIED_EXPOSED`, the other categories scaled to the longer step."""
    process_of = schedule.process_of()
    rows = len(schedule.programs())
    arrival = [min((e.start for e in sim.timeline.stage_events(p) if e.kind == ActionKind.AGREE.value),
                   default=0.0) for p in range(rows)]
    free = list(arrival)          # when each process is done with the ties before
    release = before = max(arrival)
    for nbytes, cells in ties:
        processes = sorted({process_of[c] for c in cells})
        seconds = tie_allreduce_time(nbytes, len(processes), link, algorithm)
        if seconds <= 0.0:
            continue
        end = max(free[p] for p in processes) + seconds
        for p in processes:
            free[p] = end
        release = max(release, end)
    exposed = release - before
    if exposed <= 0.0:
        return sim
    step = sim.step_time + exposed
    breakdown = {k: v * sim.step_time / step for k, v in sim.breakdown.items()}
    breakdown[TIED_EXPOSED] = exposed / step
    exact = None if sim.exact_step_time is None else sim.exact_step_time + exposed
    return dataclasses.replace(sim, step_time=step, breakdown=breakdown, exact_step_time=exact)
