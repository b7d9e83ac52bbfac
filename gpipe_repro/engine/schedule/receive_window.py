"""How many receives of each channel a stage process posts ahead on gloo.

A gloo receive must be posted (its buffer allocated) before the bytes can move, and a gloo send
cannot complete before its receive is posted, so the transport posts receives ahead of the actions
that use them (:mod:`gpipe_repro.distributed.transport`). Posting every receive of the step at its
start held a buffer for every micro-batch at once: the last stage of a 1F1B pipeline held M
activations' worth, stage 0 M gradients', so 1F1B's memory grew with M on gloo while the plan (and
the same schedule in one process) stays flat. A channel (one kind of value from one stage to
another) now has at most `window` receives posted: the first `window` at the step's start, then one
more each time one is used.

The window must not deadlock the step. Each process blocks in three places: a receive waits for its
sender's send; before a compute action it waits for its sends issued before the previous compute
action (:meth:`~gpipe_repro.distributed.transport.ProcessGroupTransport.release_sent`), each of
which completes once its receiver has posted it, that is once the receiver has used the receive
`window` places earlier on the channel; an AGREE waits for every process's. Every one of these is
"another process has got at least this far", so the processes form a monotone (Kahn) network: every
run reaches the same final state, and running the programs greedily under those rules says whether
the step completes (:func:`completes`). :func:`receive_window` takes the smallest window from
``min(M, processes)`` (at least 2) up, doubling, that completes; M, every receive at the start,
always does, and is what a fill-drain order (GPipe) takes, whose stages hold every micro-batch at once
anyway.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from gpipe_repro.engine.schedule.actions import BACKWARDS, COMPUTE, RECVS, SENDS, Action, ActionKind

__all__ = ["completes", "fill_drain", "receive_window", "sends_waited_at_first_step"]

Message = Action    # a value between processes, named by its send (the receive is its peer())


def completes(programs: Sequence[Sequence[Action]], window: int) -> bool:
    """Whether a step of `programs` (one per process) runs to its end when each process posts at
    most `window` receives ahead per channel (see the module docstring); 0: each at its own action,
    as the first step of an input signature receives (its boundary specs travel first)."""
    owner = {a.stage: p for p, actions in enumerate(programs) for a in actions}
    sent_at: dict[Message, tuple[int, int]] = {}
    received_at: dict[Message, tuple[int, int]] = {}
    channel_order: dict[tuple[ActionKind, int], list[Message]] = defaultdict(list)
    for p, actions in enumerate(programs):
        for i, a in enumerate(actions):
            if a.kind not in SENDS and a.kind not in RECVS or a.microbatch is None:
                continue
            if owner.get(a.peer().stage, p) == p:
                continue                            # handed over inside the process: no wait
            if a.kind in SENDS:
                sent_at[a] = (p, i)
            else:
                received_at[a.peer()] = (p, i)
                channel_order[(a.kind, a.peer().stage)].append(a.peer())
    # a message's receive is posted once its process has passed this index (-1: at the start);
    # window 0: when the process reaches the receive's own action
    posted_after: dict[Message, int] = {}
    for msgs in channel_order.values():
        for k, msg in enumerate(msgs):
            if window == 0:
                posted_after[msg] = received_at[msg][1] - 1
            else:
                posted_after[msg] = -1 if k < window else received_at[msgs[k - window]][1]
    sends_here = {where: msg for msg, where in sent_at.items()}
    # before each compute action: the sends issued before the previous compute action
    waits: list[dict[int, list[Message]]] = []
    for p, actions in enumerate(programs):
        computes = 0
        sends: list[tuple[Message, int]] = []
        mine: dict[int, list[Message]] = {}
        for i, a in enumerate(actions):
            if a.kind in COMPUTE:
                computes += 1
                mine[i] = [msg for msg, g in sends if g <= computes - 2]
            sent = sends_here.get((p, i))
            if sent is not None:
                sends.append((sent, computes))
        waits.append(mine)
    first_agree = [next((i for i, a in enumerate(actions) if a.kind is ActionKind.AGREE), None)
                   for actions in programs]
    pos = [0] * len(programs)

    def done_send(msg: Message) -> bool:
        sender, i = sent_at[msg]
        receiver, _ = received_at[msg]
        return pos[sender] > i and pos[receiver] > posted_after[msg]

    def ready(p: int) -> bool:
        i = pos[p]
        a = programs[p][i]
        if any(not done_send(msg) for msg in waits[p].get(i, ())):
            return False
        if a.kind in RECVS and a.microbatch is not None and a.peer() in received_at:
            sender, j = sent_at[a.peer()]
            return pos[sender] > j
        if a.kind is ActionKind.AGREE and i == first_agree[p]:
            return all(f is None or pos[q] >= f for q, f in enumerate(first_agree))
        return True

    moved_on = True
    while moved_on:
        moved_on = False
        for p, actions in enumerate(programs):
            while pos[p] < len(actions) and ready(p):
                pos[p] += 1
                moved_on = True
    return all(pos[p] == len(actions) for p, actions in enumerate(programs))


def fill_drain(programs: Sequence[Sequence[Action]]) -> bool:
    """Whether every process runs all its forwards before any backward (GPipe's order, or inference):
    then every micro-batch's activations are held at once anyway."""
    for actions in programs:
        kinds = [a.kind for a in actions]
        forwards = [i for i, k in enumerate(kinds) if k is ActionKind.FORWARD]
        backwards = [i for i, k in enumerate(kinds) if k in BACKWARDS]
        if forwards and backwards and max(forwards) > min(backwards):
            return False
    return True


def receive_window(programs: Sequence[Sequence[Action]], micro_batches: int) -> int:
    """The receives posted ahead per channel for a step of `programs` with `micro_batches`.

    A fill-drain order (:func:`fill_drain`) posts all M: its stages hold every micro-batch's
    activations at once anyway, a boundary value more each is little beside them, and the buffers
    let each stage run ahead of the other's jitter (a window of 2 made GPipe's K=2 step about 15%
    longer at M=16 and 32 on this project's host, in alternating rounds, where 1F1B's step did not
    change). Any other order: the smallest from ``min(M, processes)`` (at least 2) up, doubling,
    under which the step completes (:func:`completes`); at most M (every receive at the start,
    which always completes)."""
    if fill_drain(programs):
        return micro_batches
    window = min(micro_batches, max(2, len(programs)))
    while window < micro_batches and not completes(programs, window):
        window *= 2
    return min(window, micro_batches)


def sends_waited_at_first_step(programs: Sequence[Sequence[Action]]) -> bool:
    """Whether the first step of an input signature, which receives each value at its action, may
    still wait for its older sends before each compute action (so that what it sent is let go during
    the step, not at its end): where that completes (:func:`completes` with window 0). gpipe, 1f1b and
    zb-h1 do; interleaved and zb-v can deadlock that way, so there a first step holds its sends."""
    return completes(programs, 0)
