"""DualPipeV (DeepSeek-AI: DualPipe, "DeepSeek-V3 Technical Report", 2024, and its one-direction
"V" variant in github.com/deepseek-ai/DualPipe), in the order PyTorch ships it
(``torch.distributed.pipelining.ScheduleDualPipeV``): 2K chunks on K processes in the same V as
ZB-V (:mod:`.zero_bubble_v`), process p holding chunk d = p on the way down and u = 2K-1-p on the
way back up.

Process p's program, as PyTorch's ``_calculate_single_rank_operations`` builds it (F forward, B
whole backward, I input gradient, W the oldest weight gradient still pending, F/B an overlapped
pair)::

    1. 2(K-1-p) x F(d)                   warm-up down the V
    2. p+1 x F(d) F(u)
    3. K-1-p x I(u) W F(u)               the zero-bubble split while the pipe fills
    4. M-2K+p+1 x F(d)/B(u) F(u)/B(d)    steady state; the last process's first pair is not overlapped
    5. K-1-p x B(u) F(u)/B(d)
    6. p+1 x B(u) B(d)                   halfway through, the whole backwards become I (the W later)
    7. K-1-p x W I(d)
    8. p+1 x W

Where PyTorch overlaps a forward of one chunk with the whole backward of the other (its
``OVERLAP_F_B`` action, which its runtime runs as the forward then the backward; DeepSeek overlaps
their communication with each other's computation), this schedule has the two as consecutive
actions, the forward (its receive, compute, send) then the backward (its receive, any RECOMPUTE,
compute, send): a schedule here has no overlapped action, and on one device the two computations run
one after the other anyway. A whole backward is a BACKWARD; only steps 3, 6 and 7 split it into I and W.

It needs at least as many micro-batches as chunks, M >= 2K, as PyTorch's and DeepSeek's code ask
(process 0's warm-up alone is 2K - 1 forwards of its first chunk, and step 4 runs M-2K+p+1 times:
the steps' counts add up to M forwards of each chunk only from M = 2K - 1 on). Chunks K-1 and K
are on the same process (their send and receive stay inside it), the model's first chunk has no input
gradient to send (its I does nothing and its W runs its whole backward), and all checkpoint modes are
allowed (a RECOMPUTE right before its B or I, or before the wait for its gradient with
`recompute_ahead`).

Against ZB-V and 1F1B (the interpreter in unit time: T_F = T_I = T_W = 1 per chunk, B = I + W, an
overlapped pair F + B, instant links; tests/engine/test_schedule_dualpipe_v.py): DualPipeV takes
6M + K - 1 chunk units, the bound any order of these chunks has (the last process waits K - 1 chunk
forwards), exactly as ZB-V does; 1F1B on K cells of two chunks takes 6M + 6(K - 1). It holds at most
2K + 1 chunk forwards whose backward is not done per process (DeepSeek's "PP + 1"), one more than
ZB-V's and 1F1B's 2K. What it buys on a GPU, the overlap of one chunk's communication with the other's
computation, is outside this model; on one device per process it is ZB-V's time for one chunk's
activations more.
"""
from __future__ import annotations

from gpipe_repro.engine.schedule.actions import Action, ActionKind
from gpipe_repro.engine.schedule.core import Schedule
from gpipe_repro.engine.schedule.generators import (
    _check_sizes,
    checkpointed_microbatches,
    program_of_order,
)
from gpipe_repro.engine.schedule.zero_bubble_v import check_v_stages

__all__ = ["dualpipe_v_schedule", "check_dualpipe_v_microbatches"]

_Order = list[tuple[ActionKind, int, int]]


def check_dualpipe_v_microbatches(num_stages: int, num_microbatches: int) -> None:
    """DualPipeV needs at least as many micro-batches as chunks (M >= 2K), as PyTorch's does."""
    if num_microbatches < num_stages:
        raise ValueError(f"dualpipe-v needs at least as many micro-batches as chunks (M >= 2K, as "
                         f"PyTorch's ScheduleDualPipeV): M={num_microbatches} for {num_stages} chunks; "
                         f"use micro_batches={num_stages} or more, or schedule='zb-v' (same V, any M)")


def _dualpipe_v_process_order(k: int, p: int, m_count: int) -> _Order:
    """Process `p`'s compute order (kind, chunk, micro-batch) of K = `k` processes and M = `m_count`
    micro-batches: the eight steps of the module docstring."""
    A = ActionKind
    d, u = p, 2 * k - 1 - p
    order: _Order = []
    next_f = {d: 0, u: 0}
    next_b = {d: 0, u: 0}                  # whole backwards and I, in micro-batch order per chunk
    pending_w: list[tuple[int, int]] = []  # (chunk, micro-batch) of each I whose W is not placed

    def forward(c: int) -> None:
        order.append((A.FORWARD, c, next_f[c]))
        next_f[c] += 1

    def backward(c: int, split: bool) -> None:
        order.append((A.BACKWARD_INPUT if split else A.BACKWARD, c, next_b[c]))
        if split:
            pending_w.append((c, next_b[c]))
        next_b[c] += 1

    def oldest_weight() -> None:
        if pending_w:
            c, m = pending_w.pop(0)
            order.append((A.BACKWARD_WEIGHT, c, m))

    for _ in range(2 * (k - 1 - p)):                      # 1
        forward(d)
    for _ in range(p + 1):                                # 2
        forward(d)
        forward(u)
    for _ in range(k - 1 - p):                            # 3
        backward(u, split=True)
        oldest_weight()
        forward(u)
    for _ in range(m_count - 2 * k + p + 1):              # 4: F(d)/B(u) then F(u)/B(d)
        forward(d)
        backward(u, split=False)
        forward(u)
        backward(d, split=False)
    for _ in range(k - 1 - p):                            # 5
        backward(u, split=False)
        forward(u)
        backward(d, split=False)
    split = False                                         # 6: the split starts halfway
    for i in range(p + 1):
        split = split or (i == (p + 1) // 2 and p % 2 == 1)
        backward(u, split)
        split = split or (i == (p + 1) // 2 and p % 2 == 0)
        backward(d, split)
    for _ in range(k - 1 - p):                            # 7
        oldest_weight()
        backward(d, split)
    for _ in range(p + 1):                                # 8
        oldest_weight()
    if pending_w or not next_f[d] == next_f[u] == next_b[d] == next_b[u] == m_count:
        raise RuntimeError(f"internal error: dualpipe-v's order at K={k}, M={m_count} does not run "
                           f"every action once on process {p}; please report it")
    return order


def dualpipe_v_schedule(num_stages: int, num_microbatches: int, checkpoint: str = "never",
                        recompute_ahead: bool = False) -> Schedule:
    """DualPipeV on ``num_stages`` = 2K chunks and K processes (see the module docstring); needs
    M >= 2K. The schedule's stages are the chunks; :attr:`Schedule.processes` gives each process's
    program."""
    _check_sizes(num_stages, num_microbatches)
    check_v_stages(num_stages, "dualpipe-v")
    check_dualpipe_v_microbatches(num_stages, num_microbatches)
    ckpt = checkpointed_microbatches(checkpoint, num_microbatches)
    A = ActionKind
    k = num_stages // 2
    procs = []
    for p in range(k):
        acts = program_of_order(_dualpipe_v_process_order(k, p, num_microbatches), num_stages, ckpt,
                                recompute_ahead)
        mine = (p, num_stages - 1 - p)
        acts += [Action(A.AGREE, c) for c in mine] + [Action(A.OPTIMIZER_STEP, c) for c in mine]
        procs.append(tuple(acts))
    stages = tuple(tuple(a for prog in procs for a in prog if a.stage == s) for s in range(num_stages))
    return Schedule("dualpipe-v", num_stages, num_microbatches, stages, True, tuple(procs))
