"""The data-parallel all-reduce model and its overlap with the drain, against hand-computed values."""
from __future__ import annotations

import pytest

from gpipe_repro.engine.schedule import make_schedule
from gpipe_repro.sim.data_parallel import (
    CollectiveLink,
    allreduce_time,
    flat_allreduce,
    group_placement,
    replicate,
)
from gpipe_repro.sim.links import get_link
from gpipe_repro.sim.simulator import PipelineCosts, Simulation, simulate

LINK = CollectiveLink("test", 1e-6, 1e9)


def test_ring_and_tree_formulas() -> None:
    # ring: 2(p-1) alpha + 2(p-1)/p n/B; tree: 2 ceil(log2 p)(alpha + n/B)
    assert flat_allreduce(1e6, 4, LINK, "ring") == pytest.approx(6e-6 + 1.5e-3)
    assert flat_allreduce(1e6, 4, LINK, "tree") == pytest.approx(4 * (1e-6 + 1e-3))
    assert flat_allreduce(1e6, 1, LINK, "ring") == 0.0
    with pytest.raises(ValueError, match="algorithm must be one of"):
        flat_allreduce(1.0, 2, LINK, "butterfly")


def test_placement_follows_rank_layout() -> None:
    assert group_placement(8, 128, 8) == (1, 128)     # a pipeline per host: groups span hosts
    assert group_placement(2, 4, 8) == (4, 1)         # 4 replicas in one host
    assert group_placement(2, 128, 8) == (4, 32)      # hierarchical
    with pytest.raises(ValueError, match="does not divide"):
        group_placement(3, 4, 8)


def test_hierarchical_allreduce_is_intra_rs_inter_ar_intra_ag() -> None:
    intra, inter = CollectiveLink("a", 0.0, 100.0), CollectiveLink("b", 0.0, 80.0)
    # K=2 on hosts of 8: 4 replicas per host, 8 replicas -> 2 hosts. n = 400 bytes.
    # inside: 2 x (3/4 x 400 / 100) = 6; between: ring of 2 over 100 bytes at 80/8 = 10 B/s -> 10
    t = allreduce_time(400.0, stages=2, replicas=8, devices_per_host=8, intra=intra,
                       inter_per_host=inter)
    assert t == pytest.approx(6.0 + 10.0)


def _two_stage_sim() -> Simulation:
    # K=2, M=2, never checkpoint, forward 1 s, backward 2 s, free links: stage 1's last backward
    # ends at 7 s, stage 0's at 9 s (fill 0-3, B1 on stage 1 at 3-5, B0 at 5-7; stage 0 at 5-9).
    f, b = [[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2
    costs = PipelineCosts(f, f, f, b, [0.0, 0.0], [[0.0, 0.0]], [[0.0, 0.0]])
    return simulate(make_schedule("gpipe", 2, 2, "never", False), costs, get_link("ideal"), 8)


@pytest.mark.parametrize("stage1_bytes,exposed", [(1.5, 0.0), (3.0, 1.0)])
def test_allreduce_hidden_behind_the_drain_until_it_sticks_out(stage1_bytes: float,
                                                                 exposed: float) -> None:
    sim = _two_stage_sim()
    per_byte = CollectiveLink("slow", 0.0, 1.0)   # ring of 2: n / B seconds
    rep = replicate(sim, [0.0, stage1_bytes], replicas=2, devices_per_host=1, inter_per_host=per_byte)
    assert rep.launched == pytest.approx([9.0, 7.0])
    assert rep.exposed == pytest.approx(exposed)
    assert rep.step_time == pytest.approx(sim.step_time + exposed)
    assert rep.global_batch == 16 and rep.throughput == pytest.approx(16 / rep.step_time)


def test_one_replica_is_the_pipeline() -> None:
    sim = _two_stage_sim()
    rep = replicate(sim, [1e9, 1e9], replicas=1)
    assert rep.exposed == 0.0 and rep.step_time == sim.step_time
