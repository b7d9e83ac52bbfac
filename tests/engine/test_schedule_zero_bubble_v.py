"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6): the zero-bubble split
on 2K chunks placed in a V on K processes. Its validity, placement, unit-time makespan against the
cap any schedule with these chunks has, memory bound, training equal per parameter to plain training
(the independent reference, tests/equivalence.py) in every checkpoint mode, the same-process hand-off
in the simulator, and bad input. The distributed runtime runs it in
tests/engine/test_schedule_zero_bubble.py (ZB_CONFIGS)."""
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


def _chunk_units(a: Action) -> float:
    """T_F = T_I = T_W = 1 per chunk; the model's first chunk has no input gradient: its I is free
    and its W its whole backward (as the stage executor runs them)."""
    if a.kind is A.FORWARD:
        return 1.0
    if a.kind is A.BACKWARD_INPUT:
        return 0.0 if a.stage == 0 else 1.0
    if a.kind is A.BACKWARD_WEIGHT:
        return 2.0 if a.stage == 0 else 1.0
    return 0.0


def _span(s: Schedule, duration=_chunk_units) -> float:  # type: ignore[no-untyped-def]
    return max(e.end for e in run_dataflow(s, duration))


@pytest.mark.parametrize("k,m", [(1, 1), (1, 3), (2, 1), (2, 4), (3, 5), (4, 8)])
@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_zb_v_is_valid_round_trips_and_suits_in_order_backends(k: int, m: int, mode: str) -> None:
    for ahead in (False, True):
        s = make_schedule("zb-v", 2 * k, m, mode, ahead)
        s.validate()
        s.check_link_order()
        assert Schedule.from_text(s.to_text()) == s


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_zb_v_places_chunks_in_a_v(k: int) -> None:
    v = [p for p in range(k)] + [k - 1 - p for p in range(k)]
    assert make_schedule("zb-v", 2 * k, 4, "never").process_of() == v == owner_of_cells("zb-v", 2 * k)
    assert num_processes("zb-v", 2 * k) == k and cells_per_process("zb-v") == 2


@pytest.mark.parametrize("k,m", [(1, 4), (2, 2), (2, 4), (2, 8), (3, 6), (4, 4), (4, 16), (8, 16)])
def test_zb_v_reaches_the_cap_of_its_first_chunks_forward(k: int, m: int) -> None:
    """Each process has 6M units of work; the last one cannot start before K-1 chunk forwards have
    run, so 6M + K - 1 is a lower bound for any order of these actions. ZB-V reaches it (M >= K).
    ZB-H1 on the same model (K cells, each two chunks: unit costs doubled) is at 6M + 2(K-1) or
    more: its first cell's forward is twice a chunk's."""
    assert _span(make_schedule("zb-v", 2 * k, m, "never")) == 6 * m + k - 1
    if k > 1:
        h1 = make_schedule("zb-h1", k, m, "never")
        assert _span(h1, lambda a: 2 * _chunk_units(a)) >= 6 * m + 2 * (k - 1) > 6 * m + k - 1


@pytest.mark.parametrize("k,m", [(1, 2), (2, 4), (2, 8), (3, 7), (4, 16), (8, 16), (2, 3), (3, 4), (4, 6)])
def test_zb_v_holds_1f1b_memory_from_2k_micro_batches_and_one_more_below(k: int, m: int) -> None:
    """Chunk forwards whose W is not done, per process: at most 2K (K micro-batches of a whole cell,
    1F1B's first stage's) with the paper's handcrafted order (M >= 2K), at most 2K + 2 with the
    list-scheduled order below that, and 2K there too where that costs no time (K=2, M=3)."""
    s = make_schedule("zb-v", 2 * k, m, "never")
    assert s.processes is not None
    for program in s.processes:
        held = peak = 0
        for a in program:
            held += (a.kind is A.FORWARD) - (a.kind is A.BACKWARD_WEIGHT)
            peak = max(peak, held)
        assert peak <= (2 * k if m >= 2 * k or (k, m) == (2, 3) else 2 * k + 2)


def test_zb_v_reaches_the_bound_for_every_m_from_k_with_1f1b_memory_from_2k() -> None:
    for k in range(1, 7):
        # below 2K micro-batches the list order reaches it for K <= 4 (K=5, M=6: 41 against 40)
        for m in range(k, 2 * k if k <= 4 else 0):
            assert _span(make_schedule("zb-v", 2 * k, m, "never")) == 6 * m + k - 1, (k, m)
        for m in range(2 * k, 4 * k + 3):
            s = make_schedule("zb-v", 2 * k, m, "never")
            assert _span(s) == 6 * m + k - 1, (k, m)
            assert s.processes is not None
            assert max(sum(a.kind is A.FORWARD for a in prog[:i]) - sum(a.kind is A.BACKWARD_WEIGHT
                                                                        for a in prog[:i])
                       for prog in s.processes for i in range(len(prog) + 1)) <= 2 * k


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_zb_v_trains_equal_to_plain_training(kind: str, mode: str) -> None:
    build, loss_fn = MODELS[kind]
    batches = [data(kind, seed=3 + step) for step in range(3)]
    for i, (cells, m) in enumerate([(2, 3), (4, 4), (4, 7), (4, 3)]):   # (4, 3): list order
        assert_same_training(build(), None, None, loss_fn, partitions=cells, micro_batches=m,
                             checkpoint=mode, batches=batches, optimizer=sgd_momentum, atol=1e-5,
                             schedule="zb-v", recompute_ahead=bool(i % 2))


def test_zb_v_refuses_an_odd_number_of_partitions() -> None:
    from gpipe_repro import GPipe
    build, loss_fn = MODELS["mlp"]
    with pytest.raises(ValueError, match="zb-v cuts the model into 2K chunks.*use partitions=4"):
        GPipe(build(), partitions=3, micro_batches=2, schedule="zb-v", loss_fn=loss_fn)
    with pytest.raises(ValueError, match="not even"):
        make_schedule("zb-v", 5, 4, "never")


def test_simulated_hand_off_inside_a_process_is_free() -> None:
    """Chunks K-1 and K are on one process: the simulator charges their send and receive nothing.
    With K=1 (both chunks on one process) a slow link changes nothing; with K=2 it does."""
    from gpipe_repro.sim.links import LinkModel
    from gpipe_repro.sim.simulator import PipelineCosts, simulate
    slow = LinkModel("slow", latency=0.5, bandwidth=1e12)
    instant = LinkModel("instant", latency=0.0, bandwidth=1e12)
    m = 4
    for cells in (2, 4):
        ones = [[1.0] * m for _ in range(cells)]
        zeros = [[0.0] * m for _ in range(cells - 1)]
        costs = PipelineCosts(ones, ones, ones, [[2.0] * m for _ in range(cells)], [0.0] * cells,
                              zeros, zeros, backward_input=ones)
        schedule = make_schedule("zb-v", cells, m, "never")
        steps = [simulate(schedule, costs, link, batch_size=m).step_time for link in (instant, slow)]
        assert (steps[1] == steps[0]) if cells == 2 else (steps[1] > steps[0]), (cells, steps)
