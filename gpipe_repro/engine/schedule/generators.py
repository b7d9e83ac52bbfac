"""The single-process-per-stage schedules: GPipe fill-drain, 1F1B (PipeDream-flush) and zero-bubble
ZB-H1, with the forward and backward blocks every generator (interleaved 1F1B too) builds from."""
from __future__ import annotations

from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.schedule.actions import CHECKPOINT_MODES, Action, ActionKind
from gpipe_repro.engine.schedule.core import Schedule

__all__ = ["checkpointed_microbatches", "gpipe_schedule", "one_f_one_b_schedule",
           "zero_bubble_h1_schedule", "program_of_order"]


def checkpointed_microbatches(mode: str, num_microbatches: int) -> frozenset[int]:
    """Which micro-batches re-materialize under a checkpoint mode."""
    require_one_of("checkpoint", mode, CHECKPOINT_MODES)
    if mode == "never":
        return frozenset()
    if mode == "always":
        return frozenset(range(num_microbatches))
    return frozenset(range(num_microbatches - 1))


def _backward_block(s: int, k: int, mb: int, ckpt: frozenset[int], ahead: bool) -> list[Action]:
    A = ActionKind
    recv = [Action(A.RECV_GRAD, s, mb)] if s < k - 1 else []
    rec = [Action(A.RECOMPUTE, s, mb)] if mb in ckpt else []
    out = rec + recv if ahead else recv + rec
    out.append(Action(A.BACKWARD, s, mb))
    if s > 0:
        out.append(Action(A.SEND_GRAD, s, mb))
    return out


def _forward_block(s: int, k: int, mb: int) -> list[Action]:
    A = ActionKind
    out = [Action(A.RECV_ACT, s, mb)] if s > 0 else []
    out.append(Action(A.FORWARD, s, mb))
    if s < k - 1:
        out.append(Action(A.SEND_ACT, s, mb))
    return out


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"the number of stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"the number of micro-batches must be >= 1, got {num_microbatches}")


def gpipe_schedule(num_stages: int, num_microbatches: int, checkpoint: str = "except_last",
                   recompute_ahead: bool = False, training: bool = True) -> Schedule:
    """GPipe fill-drain: all forwards, then all backwards in reverse micro-batch order, then update."""
    _check_sizes(num_stages, num_microbatches)
    ckpt = checkpointed_microbatches(checkpoint, num_microbatches) if training else frozenset()
    stages = []
    for s in range(num_stages):
        acts = [a for mb in range(num_microbatches) for a in _forward_block(s, num_stages, mb)]
        if training:
            for mb in reversed(range(num_microbatches)):
                acts += _backward_block(s, num_stages, mb, ckpt, recompute_ahead)
            acts += [Action(ActionKind.AGREE, s), Action(ActionKind.OPTIMIZER_STEP, s)]
        stages.append(tuple(acts))
    return Schedule("gpipe" if training else "forward", num_stages, num_microbatches, tuple(stages),
                    training)


def one_f_one_b_schedule(num_stages: int, num_microbatches: int, checkpoint: str = "never",
                         recompute_ahead: bool = False) -> Schedule:
    """1F1B (PipeDream-flush): after a warm-up of K-1-s forwards, stage s alternates one forward and
    one backward, so it holds at most K-s micro-batches in flight instead of M. Same update semantics
    as GPipe; shown for comparison."""
    _check_sizes(num_stages, num_microbatches)
    ckpt = checkpointed_microbatches(checkpoint, num_microbatches)
    stages = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_microbatches)
        acts: list[Action] = []
        for mb in range(warmup):
            acts += _forward_block(s, num_stages, mb)
        for i in range(num_microbatches - warmup):
            acts += _forward_block(s, num_stages, warmup + i)
            acts += _backward_block(s, num_stages, i, ckpt, recompute_ahead)
        for mb in range(num_microbatches - warmup, num_microbatches):
            acts += _backward_block(s, num_stages, mb, ckpt, recompute_ahead)
        acts += [Action(ActionKind.AGREE, s), Action(ActionKind.OPTIMIZER_STEP, s)]
        stages.append(tuple(acts))
    return Schedule("1f1b", num_stages, num_microbatches, tuple(stages))


def _zb_h1_order(num_stages: int, num_microbatches: int) -> list[list[tuple[ActionKind, int]]]:
    """Each stage's compute order for ZB-H1, the paper's handcrafted one (Qi et al. 2024, figure 3):
    stage s runs min(K-s, M) forwards (1F1B's warm-up plus one), then, for each micro-batch j in
    turn, its input gradient I_j, the weight gradient W_{j-s} (stage s lags its W by s, the idle
    time it would otherwise have while its gradients come back up), and its next forward; the W
    still pending come last.

    With T_F = T_I = T_W (the paper's assumption; instant links) this takes exactly 3M + K - 1
    units for every M >= K: the paper's bubble (p-1)(T_F + T_B - T_W), the least any order can
    take (stage K-1 cannot start before K-1 forwards have passed). A stage holds at most K-s
    micro-batches whose I is not done and at most K whose W is not done: 1F1B's activation memory
    (stage 0's K is the peak over stages). The list-scheduling order used before (I, else F under
    those two limits, else the oldest W) took up to 4 units more (29 against 27 at K=4, M=8; K-1
    more at M = K), and never fewer (K <= 9, M <= 32, tests/engine/test_schedule_zero_bubble.py)."""
    k, m_count = num_stages, num_microbatches
    A = ActionKind
    order: list[list[tuple[ActionKind, int]]] = []
    for s in range(k):
        warmup = min(k - s, m_count)
        acts = [(A.FORWARD, mb) for mb in range(warmup)]
        for j in range(m_count):
            acts.append((A.BACKWARD_INPUT, j))
            if j >= s:
                acts.append((A.BACKWARD_WEIGHT, j - s))
            if warmup + j < m_count:
                acts.append((A.FORWARD, warmup + j))
        acts += [(A.BACKWARD_WEIGHT, mb) for mb in range(max(0, m_count - s), m_count)]
        order.append(acts)
    return order


def zero_bubble_h1_schedule(num_stages: int, num_microbatches: int, checkpoint: str = "never",
                            recompute_ahead: bool = False) -> Schedule:
    """ZB-H1 (Qi, Wan, Huang, Lin: "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3): every
    backward is split into its input gradient (I, what the previous stage waits for) and its weight
    gradient (W, what nobody waits for), and the W are placed where 1F1B idles. Same in-flight limit
    as 1F1B (at most K-s micro-batches whose W is not done on stage s), so about 1F1B's activation
    memory, and with T_F = T_I = T_W the bubble drops from 1F1B's 3(K-1) units to (K-1): the
    paper's (p-1)(T_F + T_B - T_W). Re-materialization: a checkpointed micro-batch's RECOMPUTE comes
    right before its I (or before the wait for its gradient with `recompute_ahead`); its graph then
    lives until its W. All checkpoint modes are allowed."""
    _check_sizes(num_stages, num_microbatches)
    ckpt = checkpointed_microbatches(checkpoint, num_microbatches)
    A = ActionKind
    stages = []
    for s, order in enumerate(_zb_h1_order(num_stages, num_microbatches)):
        acts = program_of_order([(kind, s, mb) for kind, mb in order], num_stages, ckpt,
                                recompute_ahead)
        acts += [Action(A.AGREE, s), Action(A.OPTIMIZER_STEP, s)]
        stages.append(tuple(acts))
    return Schedule("zb-h1", num_stages, num_microbatches, tuple(stages))


def program_of_order(order: list[tuple[ActionKind, int, int]], num_stages: int,
                     ckpt: frozenset[int], recompute_ahead: bool) -> list[Action]:
    """A compute order, (FORWARD | BACKWARD | BACKWARD_INPUT | BACKWARD_WEIGHT, stage, micro-batch)
    in the order a process runs them, as actions: each forward with its receive and send, each
    whole backward (B) or input gradient (I) with its gradient's receive, its RECOMPUTE if
    checkpointed and its send, each W alone."""
    A = ActionKind
    acts: list[Action] = []
    for kind, s, mb in order:
        if kind is A.FORWARD:
            acts += _forward_block(s, num_stages, mb)
        elif kind is A.BACKWARD:
            acts += _backward_block(s, num_stages, mb, ckpt, recompute_ahead)
        elif kind is A.BACKWARD_INPUT:
            acts += [Action(A.BACKWARD_INPUT, s, mb) if a.kind is A.BACKWARD else a
                     for a in _backward_block(s, num_stages, mb, ckpt, recompute_ahead)]
        else:
            acts.append(Action(A.BACKWARD_WEIGHT, s, mb))
    return acts
