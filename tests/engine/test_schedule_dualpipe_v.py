"""DualPipeV (DeepSeek-V3's DualPipe in a V, in the order of PyTorch's ``ScheduleDualPipeV``) on 2K
chunks placed in a V on K processes: the same compute order as PyTorch's, its validity, placement,
unit-time makespan and held activations against ZB-V and 1F1B, training equal per parameter to plain
training (the independent reference, tests/equivalence.py) in every checkpoint mode, and bad input.
The distributed runtime runs it in tests/distributed/test_equivalence.py (CONFIGS[2])."""
from __future__ import annotations

import pytest

from gpipe_repro.engine.interpreter import run_dataflow
from gpipe_repro.engine.schedule import (
    Action,
    ActionKind,
    Schedule,
    cells_per_process,
    make_schedule,
    num_processes,
    owner_of_cells,
)
from tests.engine.test_equivalence import MODELS, data
from tests.equivalence import assert_same_training, sgd_momentum

A = ActionKind
_COMPUTE_ORDER = (A.FORWARD, A.BACKWARD, A.BACKWARD_INPUT, A.BACKWARD_WEIGHT)


def _chunk_units(a: Action) -> float:
    """T_F = T_I = T_W = 1 per chunk, a whole backward 2; the model's first chunk has no input
    gradient: its I is free and its W its whole backward (as the stage executor runs them)."""
    if a.kind is A.FORWARD:
        return 1.0
    if a.kind is A.BACKWARD:
        return 2.0
    if a.kind is A.BACKWARD_INPUT:
        return 0.0 if a.stage == 0 else 1.0
    if a.kind is A.BACKWARD_WEIGHT:
        return 2.0 if a.stage == 0 else 1.0
    return 0.0


def _span(s: Schedule, duration=_chunk_units) -> float:  # type: ignore[no-untyped-def]
    return max(e.end for e in run_dataflow(s, duration))


def _held_peak(s: Schedule) -> int:
    """The most chunk forwards whose backward (B, or W of a split one) is not done, over processes."""
    peak = 0
    for program in s.programs():
        held = 0
        for a in program:
            held += (a.kind is A.FORWARD) - (a.kind in (A.BACKWARD, A.BACKWARD_WEIGHT))
            peak = max(peak, held)
    return peak


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_compute_order_is_pytorchs_with_each_overlapped_pair_as_forward_then_backward(k: int) -> None:
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as torch_schedules
    kinds = {torch_schedules.FORWARD: A.FORWARD, torch_schedules.FULL_BACKWARD: A.BACKWARD,
             torch_schedules.BACKWARD_INPUT: A.BACKWARD_INPUT,
             torch_schedules.BACKWARD_WEIGHT: A.BACKWARD_WEIGHT}
    rank_order = torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations
    for m in (2 * k, 2 * k + 3):
        ours = make_schedule("dualpipe-v", 2 * k, m, "never")
        assert ours.processes is not None
        torch_side = SimpleNamespace(pp_group_size=k, _n_microbatches=m)   # all the order reads
        for rank in range(k):
            theirs = [Action(kinds[sub.computation_type], sub.stage_index, sub.microbatch_index)
                      for op in rank_order(torch_side, rank)
                      for sub in (op.sub_actions or (op,))]
            assert [a for a in ours.processes[rank] if a.kind in _COMPUTE_ORDER] == theirs, (k, m, rank)


@pytest.mark.parametrize("k,m", [(1, 2), (1, 5), (2, 4), (2, 7), (3, 6), (4, 9)])
@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_dualpipe_v_is_valid_round_trips_and_suits_in_order_backends(k: int, m: int, mode: str) -> None:
    for ahead in (False, True):
        s = make_schedule("dualpipe-v", 2 * k, m, mode, ahead)
        s.validate()
        s.check_link_order()
        assert Schedule.from_text(s.to_text()) == s


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dualpipe_v_places_chunks_in_the_same_v_as_zb_v(k: int) -> None:
    v = [p for p in range(k)] + [k - 1 - p for p in range(k)]
    assert make_schedule("dualpipe-v", 2 * k, 2 * k, "never").process_of() == v
    assert owner_of_cells("dualpipe-v", 2 * k) == v == owner_of_cells("zb-v", 2 * k)
    assert num_processes("dualpipe-v", 2 * k) == k and cells_per_process("dualpipe-v") == 2


def test_dualpipe_v_ties_zb_v_at_the_bound_and_beats_1f1b_for_one_chunk_forward_more() -> None:
    """Unit time, instant links: each process has 6M chunk units of work and the last one cannot
    start before K-1 chunk forwards, so 6M + K - 1 bounds any order; DualPipeV (an overlapped pair
    run as its forward then its backward) reaches it, as ZB-V does. 1F1B on K cells of two chunks
    each takes 6M + 6(K-1). DualPipeV holds 2K + 1 chunk forwards per process (PP + 1 in DeepSeek's
    table), ZB-V and 1F1B's first stage 2K."""
    for k in range(1, 6):
        for m in (2 * k, 2 * k + 1, 4 * k + 3):
            dual, zbv = (make_schedule(n, 2 * k, m, "never") for n in ("dualpipe-v", "zb-v"))
            one_f_one_b = make_schedule("1f1b", k, m, "never")
            assert _span(dual) == _span(zbv) == 6 * m + k - 1, (k, m)
            assert _span(one_f_one_b, lambda a: 2 * _chunk_units(a)) == 6 * m + 6 * (k - 1), (k, m)
            assert _held_peak(dual) == 2 * k + 1 and _held_peak(zbv) == 2 * k, (k, m)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_dualpipe_v_trains_equal_to_plain_training(kind: str, mode: str) -> None:
    build, loss_fn = MODELS[kind]
    batches = [data(kind, seed=3 + step) for step in range(3)]
    for i, (cells, m) in enumerate([(2, 3), (4, 5)]):   # M=5 of 11 examples: uneven micro-batches
        assert_same_training(build(), None, None, loss_fn, partitions=cells, micro_batches=m,
                             checkpoint=mode, batches=batches, optimizer=sgd_momentum, atol=1e-5,
                             schedule="dualpipe-v", recompute_ahead=bool(i % 2))


def test_dualpipe_v_refuses_fewer_micro_batches_than_chunks_and_an_odd_partition_count() -> None:
    from gpipe_repro import GPipe
    build, loss_fn = MODELS["mlp"]
    with pytest.raises(ValueError, match=r"dualpipe-v needs at least as many micro-batches as chunks.*"
                                         r"M=3 for 4 chunks; use micro_batches=4 or more"):
        make_schedule("dualpipe-v", 4, 3, "never")
    with pytest.raises(ValueError, match="use micro_batches=4 or more, or schedule='zb-v'"):
        GPipe(build(), partitions=4, micro_batches=3, schedule="dualpipe-v", loss_fn=loss_fn,
              optimizer=sgd_momentum)   # at construction, not at the first step
    with pytest.raises(ValueError, match="dualpipe-v cuts the model into 2K chunks.*use partitions=4"):
        GPipe(build(), partitions=3, micro_batches=4, schedule="dualpipe-v", loss_fn=loss_fn)
