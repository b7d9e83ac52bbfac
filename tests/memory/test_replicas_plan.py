"""The K x R planner: every K dividing N is considered with R = N / K; its choice is the fastest that
fits, with the all-reduce's exposed time and bucket memory accounted."""
from __future__ import annotations

import pytest
import torch

from gpipe_repro.memory.planner import GiB, MemoryPlanner
from gpipe_repro.memory.replicas_plan import plan_replicas
from gpipe_repro.models.transformer_lm import lm_loss, transformer_lm
from gpipe_repro.sim.links import get_link


def _planner() -> MemoryPlanner:
    with torch.device("meta"):
        layers = list(transformer_lm(4, d_model=64, d_ff=128, num_heads=4, vocab_size=100))
    ids = torch.empty(8, 16, dtype=torch.long, device="meta")
    return MemoryPlanner(layers, ids, ids, lm_loss)


def test_plan_replicas_covers_every_k_and_ranks_by_job_throughput() -> None:
    cands = plan_replicas(_planner(), 8, 1.0 * GiB, get_link("nvlink"), 1e12, micro_batches=[1, 2],
                          checkpoints=("never",))
    assert {(c.partitions, c.replicas) for c in cands} == {(1, 8), (2, 4), (4, 2)}
    fitting = [c for c in cands if c.fits]
    assert fitting and fitting == sorted(fitting, key=lambda c: -c.throughput) and cands[0].fits
    for c in fitting:
        assert c.result is not None
        assert c.throughput == pytest.approx(c.replicas * 8 / c.result.step_time)
        assert c.peak_with_buckets > c.pipeline.max_peak   # the gradient buckets' copy
    tight = plan_replicas(_planner(), 8, 1.0, get_link("nvlink"), 1e12, micro_batches=[1],
                          checkpoints=("never",))
    assert not any(c.fits for c in tight)


def test_plan_replicas_tried_powers_of_two_only_and_found_nothing_on_6_devices() -> None:
    """K went 1, 2, 4, ...: on 6 devices only K=1 and 2 were tried, and a model that fits at K=3 or 6
    was answered 'nothing fits'. Every K dividing the devices is tried now where pipelines lie on
    hosts whole (K divides a host's devices or is a multiple of them); a pipeline of 3 on hosts of
    2 devices, which the simulation took over host boundaries unasked, is refused by name."""
    from gpipe_repro.sim.data_parallel import group_placement

    cands = plan_replicas(_planner(), 6, 1.0 * GiB, get_link("nvlink"), 1e12, micro_batches=[1],
                          checkpoints=("never",))
    assert {c.partitions for c in cands} == {1, 2, 3, 6}
    on_pairs = plan_replicas(_planner(), 6, 1.0 * GiB, get_link("nvlink"), 1e12, micro_batches=[1],
                             checkpoints=("never",), devices_per_host=2)
    assert {c.partitions for c in on_pairs} == {1, 2, 6}     # 6: three whole hosts
    with pytest.raises(ValueError, match="K=3 is not a multiple of the 2 devices of a host"):
        group_placement(3, 2, 2)
