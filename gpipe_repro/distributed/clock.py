"""One clock for every stage process, so their timelines can be drawn on one axis.

Each process timestamps its actions with ``time.perf_counter()`` (monotonic, sub-microsecond). On one
host that is the same clock (CLOCK_MONOTONIC) in every process, so no correction is needed and none
is applied. Across hosts the clocks differ by an unknown offset, which we estimate NTP-style against
rank 0: rank r sends its time t1, rank 0 answers with its time t0, rank r reads t2 on arrival; then
``offset = t0 - (t1 + t2) / 2`` with an error below half the round trip, and the round with the
shortest round trip wins. Rank r's corrected time is ``perf_counter() + offset``.
:func:`merge_timelines` puts the ranks' events, so timed, on one axis.
"""
from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from gpipe_repro.engine.schedule import ActionKind
from gpipe_repro.engine.timeline import Event, Timeline


def estimate_offset(group: dist.ProcessGroup | None = None, rounds: int = 8) -> float:
    """This rank's clock offset to rank 0 (seconds to add to perf_counter). Collective: every rank
    of `group` (a CPU-capable group: gloo) must call it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    best = (float("inf"), 0.0)  # (round trip, offset)
    buf = torch.zeros(1, dtype=torch.float64)
    for peer in range(1, world):
        for _ in range(rounds):
            if rank == 0:
                dist.recv(buf, peer, group=group)
                buf.fill_(time.perf_counter())
                dist.send(buf, peer, group=group)
            elif rank == peer:
                t1 = time.perf_counter()
                buf.fill_(t1)
                dist.send(buf, 0, group=group)
                dist.recv(buf, 0, group=group)
                t2 = time.perf_counter()
                best = min(best, (t2 - t1, float(buf.item()) - (t1 + t2) / 2))
    return best[1]


def clock_offset(group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """(offset to apply, offset estimated): the estimate is applied only if the ranks are on
    different hosts (on one host every process reads the same monotonic clock)."""
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    estimate = estimate_offset(group)
    return (0.0 if len(set(hosts)) == 1 else estimate), estimate


def merge_timelines(per_rank: list[tuple[float, list[tuple[str, int | None, float, float, int | None]]]],
                    meta: dict[str, Any], ranks_per_pipeline: int | None = None) -> Timeline:
    """One Timeline from each rank's (step start, [(kind, micro-batch, start, end, cell)]), all on
    one clock: times become seconds from the earliest step start, receives get ``ready`` (from the
    send of the same replica's neighbouring stage; ranks come in replicas of `ranks_per_pipeline`,
    by default one). A cell (the schedule's stage, where a rank runs several) stays on its event."""
    per_pipeline = ranks_per_pipeline or len(per_rank)
    origin = min(start for start, _ in per_rank)
    events = [Event(rank, kind, mb, s - origin, e - origin, cell=cell)
              for rank, (_, evs) in enumerate(per_rank) for kind, mb, s, e, cell in evs]

    def position(e: Event) -> tuple[int, int]:      # (replica, the schedule's stage)
        return e.stage // per_pipeline, (e.stage % per_pipeline if e.cell is None else e.cell)

    send_start = {(*position(e), e.kind, e.microbatch): e.start for e in events
                  if e.kind in (ActionKind.SEND_ACT.value, ActionKind.SEND_GRAD.value)}
    for e in events:
        replica, stage = position(e)
        if e.kind == ActionKind.RECV_ACT.value:
            e.ready = send_start.get((replica, stage - 1, ActionKind.SEND_ACT.value, e.microbatch))
        elif e.kind == ActionKind.RECV_GRAD.value:
            e.ready = send_start.get((replica, stage + 1, ActionKind.SEND_GRAD.value, e.microbatch))
    return Timeline(len(per_rank), events, meta)
