"""ZB-V (Qi, Wan, Huang, Lin: "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6; PyTorch's
``ScheduleZBVZeroBubble``): the zero-bubble split (I, W) on a model cut into 2K chunks placed in a V
on K processes, process p holding chunks p and 2K-1-p, so the first process runs the model's first
and last chunks and the forward goes down the processes and back up.

Why a V: the last process cannot start before the first one's first forward, so every schedule idles
one forward of the first chunk. With one cell per process that is a third of a micro-batch's work
on a cell (T_B = 2 T_F): at K=2 any such schedule takes at least 3M + 1 units for 3M of work, 0.923
of the ideal at M=4. A V's first chunk is half a process's share, so the cap becomes 6M / (6M + K -
1): 0.96 at K=2, M=4. And since the loss is on the first process, the backward starts where the
forward began, with no cross-process round trip between the last forward and the first backward.

For M >= 2K the order is the paper's handcrafted one (:func:`_v_order_handcrafted`): it reaches 6M +
K - 1 chunk units, the cap above, holding at most 2K chunk forwards whose W is not done per process:
exactly 1F1B's activation memory (K micro-batches of a whole cell). Below 2K micro-batches that
order has no steady state, and the order is made by list scheduling in unit time (T_F = T_I = T_W
per chunk, except the model's first chunk, whose I is free and whose W is its whole backward, as the
runtime runs them; instant links): a free process runs, in this priority, an input gradient (I)
whose gradient has arrived (oldest micro-batch first, then the chunk later in the model), else a
forward (the chunk later in the model first, so micro-batches reach the loss early) while fewer than
a limit of its chunk forwards await their W, else its oldest pending weight gradient (W). The limit
is 2K (1F1B's memory) where that order is as short as with 2K + 2, else 2K + 2 (one micro-batch
more): with 2K, K=4 takes 34 units at M=5 and 40 at M=6, against the cap's 33 and 39. For K <= 4
every M from K to 2K reaches the cap (tests/engine/test_schedule_zero_bubble_v.py); from K=5 list
scheduling misses it by 1 to 4 units at some M < 2K (K=5, M=6: 41 against 40; K=8, M=9: 65 against
61), so use M >= 2K there, as the paper does.

Chunks K-1 and K are on the same process: their send and receive stay inside it (the distributed
transport hands the value over in memory). Like ZB-H1, the model's first chunk has no input gradient
to send: its I does nothing and its W runs its whole backward. All checkpoint modes are allowed (a
RECOMPUTE right before its I, or before the wait for its gradient with `recompute_ahead`).
"""
from __future__ import annotations

from gpipe_repro.engine.schedule.actions import Action, ActionKind
from gpipe_repro.engine.schedule.core import Schedule
from gpipe_repro.engine.schedule.generators import (
    _check_sizes,
    checkpointed_microbatches,
    program_of_order,
)

__all__ = ["zero_bubble_v_schedule", "check_v_stages"]


def check_v_stages(num_stages: int, name: str = "zb-v") -> None:
    """A V schedule (`name`: zb-v, dualpipe-v) needs an even number of stages (chunks): two per
    process."""
    if num_stages < 2 or num_stages % 2:
        raise ValueError(f"{name} cuts the model into 2K chunks for K processes (two per process, in a V): "
                         f"{num_stages} stages (partitions) is not even; use partitions="
                         f"{max(2, num_stages + num_stages % 2)}")


def _v_order(num_stages: int, num_microbatches: int,
             limit: int) -> tuple[list[list[tuple[ActionKind, int, int]]], int]:
    """Each process's compute order (kind, chunk, micro-batch), by list scheduling in unit time with
    at most `limit` chunk forwards awaiting their W per process (see the module docstring), and its
    makespan in those units."""
    c_count, m_count = num_stages, num_microbatches
    k = c_count // 2
    A = ActionKind
    chunks = [(p, c_count - 1 - p) for p in range(k)]
    f_end: list[list[int | None]] = [[None] * m_count for _ in range(c_count)]
    i_end: list[list[int | None]] = [[None] * m_count for _ in range(c_count)]
    next_f, next_i = [0] * c_count, [0] * c_count
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    holding = [0] * k                      # chunk forwards on the process whose W is not done
    order: list[list[tuple[ActionKind, int, int]]] = [[] for _ in range(k)]

    def done_by(end: int | None, t: int) -> bool:
        return end is not None and end <= t

    # Durations in units of one chunk's forward: F = I = W = 1, except the model's first chunk, which
    # has no input gradient: its I is free and its W is its whole backward (2), as the runtime runs it.
    free_at = [0] * k
    t, left = 0, 3 * c_count * m_count
    while left:
        if t > 2 * left + 6 * c_count * m_count:   # every action lasts <= 2 units: a stuck order
            raise RuntimeError(f"internal error: zb-v's list scheduling is stuck at K={k}, "
                               f"M={m_count}; please report it")
        for p in range(k):
            while free_at[p] <= t and left:
                ready_i = [(m, -c) for c in chunks[p] for m in (next_i[c],)
                           if m < next_f[c] and done_by(f_end[c][m], t)
                           and (c == c_count - 1 or done_by(i_end[c + 1][m], t))]
                ready_f = [(-c, m) for c in chunks[p] for m in (next_f[c],)
                           if m < m_count and (c == 0 or done_by(f_end[c - 1][m], t))]
                if ready_i:
                    m, c = min(ready_i)
                    c = -c
                    order[p].append((A.BACKWARD_INPUT, c, m))
                    free_at[p] = i_end[c][m] = t + (0 if c == 0 else 1)
                    next_i[c] += 1
                    pending_w[p].append((c, m))
                elif ready_f and holding[p] < limit:
                    c, m = min(ready_f)
                    c = -c
                    order[p].append((A.FORWARD, c, m))
                    free_at[p] = f_end[c][m] = t + 1
                    next_f[c] += 1
                    holding[p] += 1
                elif pending_w[p]:
                    c, m = pending_w[p].pop(0)
                    order[p].append((A.BACKWARD_WEIGHT, c, m))
                    free_at[p] = t + (2 if c == 0 else 1)
                    holding[p] -= 1
                else:
                    break
                left -= 1
        t += 1
    return order, max(free_at)


def _v_order_handcrafted(num_stages: int, num_microbatches: int) -> list[list[tuple[ActionKind, int, int]]]:
    """Each process's compute order for M >= 2K: the paper's handcrafted ZB-V (Qi et al. 2024,
    section 6, figure 8), in the phases PyTorch's ``ScheduleZBVZeroBubble`` spells out. Process p,
    holding chunks d = p (going down) and u = 2K-1-p (coming back up):

    1. warm-up: 2(K-p) - 1 forwards of d; then p times a forward of u and one of d; then K-p
       times a forward of u with its I and W at once;
    2. steady state: a forward of d (while any is left), I and W of d, a forward of u, I and W of u,
       until every forward is done;
    3. cool-down: p times I of d and I of u; K-p times I of d and the oldest W of d; then the
       remaining W of u, then of d.

    With T_F = T_I = T_W it takes 6M + K - 1 chunk units, the bound, holding at most 2K chunk
    forwards whose W is not done: exactly 1F1B's activation memory (K micro-batches of a cell)."""
    k = num_stages // 2
    return [_v_process_order(k, p, num_microbatches) for p in range(k)]


def _v_process_order(k: int, p: int, m_count: int) -> list[tuple[ActionKind, int, int]]:
    """Process `p`'s part of :func:`_v_order_handcrafted` (K = `k` processes, M = `m_count`)."""
    A = ActionKind
    d, u = p, 2 * k - 1 - p
    acts: list[tuple[ActionKind, int, int]] = []
    nf = {d: 0, u: 0}
    ni = {d: 0, u: 0}
    nw = {d: 0, u: 0}
    count_of = {A.FORWARD: nf, A.BACKWARD_INPUT: ni, A.BACKWARD_WEIGHT: nw}

    def run(kind: ActionKind, c: int) -> None:
        acts.append((kind, c, count_of[kind][c]))
        count_of[kind][c] += 1
    for _ in range(2 * (k - p) - 1):
        run(A.FORWARD, d)
    for _ in range(p):
        run(A.FORWARD, u)
        run(A.FORWARD, d)
    for _ in range(k - p):
        run(A.FORWARD, u)
        run(A.BACKWARD_INPUT, u)
        run(A.BACKWARD_WEIGHT, u)
    while nf[u] < nf[d] or nf[d] < m_count:
        if nf[d] < m_count:
            run(A.FORWARD, d)
        run(A.BACKWARD_INPUT, d)
        run(A.BACKWARD_WEIGHT, d)
        run(A.FORWARD, u)
        run(A.BACKWARD_INPUT, u)
        run(A.BACKWARD_WEIGHT, u)
    for _ in range(p):
        run(A.BACKWARD_INPUT, d)
        run(A.BACKWARD_INPUT, u)
    for _ in range(k - p):
        run(A.BACKWARD_INPUT, d)
        run(A.BACKWARD_WEIGHT, d)
    while nw[u] < ni[u]:
        run(A.BACKWARD_WEIGHT, u)
    while nw[d] < ni[d]:
        run(A.BACKWARD_WEIGHT, d)
    if not nf[d] == ni[d] == nw[d] == nf[u] == ni[u] == nw[u] == m_count:
        raise RuntimeError(f"internal error: zb-v's order at K={k}, M={m_count} does not run "
                           f"every action once on process {p}; please report it")
    return acts


def zero_bubble_v_schedule(num_stages: int, num_microbatches: int, checkpoint: str = "never",
                           recompute_ahead: bool = False) -> Schedule:
    """ZB-V on ``num_stages`` = 2K chunks and K processes (see the module docstring). The schedule's
    stages are the chunks; :attr:`Schedule.processes` gives each process's program."""
    _check_sizes(num_stages, num_microbatches)
    check_v_stages(num_stages)
    ckpt = checkpointed_microbatches(checkpoint, num_microbatches)
    A = ActionKind
    procs = []
    if num_microbatches >= num_stages:
        orders = _v_order_handcrafted(num_stages, num_microbatches)
    else:        # 1F1B's memory where that reaches the list order's best, else one micro-batch more
        (lean, lean_span), (roomy, roomy_span) = (_v_order(num_stages, num_microbatches, limit)
                                                  for limit in (num_stages, num_stages + 2))
        orders = lean if lean_span <= roomy_span else roomy
    for p, order in enumerate(orders):
        acts = program_of_order(order, num_stages, ckpt, recompute_ahead)
        mine = (p, num_stages - 1 - p)
        acts += [Action(A.AGREE, c) for c in mine] + [Action(A.OPTIMIZER_STEP, c) for c in mine]
        procs.append(tuple(acts))
    stages = tuple(tuple(a for prog in procs for a in prog if a.stage == s) for s in range(num_stages))
    return Schedule("zb-v", num_stages, num_microbatches, stages, True, tuple(procs))
