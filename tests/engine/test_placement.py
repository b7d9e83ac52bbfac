"""Which process runs which stage (gpipe_repro/engine/placement.py), without starting processes."""
from __future__ import annotations

import pytest

from gpipe_repro.engine.placement import RUNTIMES, place_stages, runtime_plugin
from gpipe_repro.engine.schedule import make_schedule


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_the_local_runtime_runs_every_stage_in_one_process(schedule: str) -> None:
    p = place_stages(runtime="local", schedule=schedule, partitions=4, checkpoint="never", replicas=1)
    assert (p.processes, p.process_of, p.stages_here) == (4, [0, 1, 2, 3], [0, 1, 2, 3])
    assert (p.rank, p.replica, p.plugin, p.context) == (None, 0, None, None)
    assert p.same_on_every_rank([3, 1]) == [3, 1]


def test_only_the_distributed_runtime_has_a_plugin() -> None:
    assert RUNTIMES == ("local", "distributed")
    assert runtime_plugin("local") is None
    assert hasattr(runtime_plugin("distributed"), "DistributedRuntime")


def test_interleaved_stages_share_processes_as_the_schedule_says() -> None:
    # Interleaved 1F1B with K=2 processes runs cells s and s + K on process s (round robin);
    # replicas of such a pipeline are refused before any process group is started.
    expected = make_schedule("interleaved", 4, 2, "never").process_of()
    assert expected == [0, 1, 0, 1]
    with pytest.raises(ValueError, match=r"replicas=2.*not supported.*use replicas=1"):
        place_stages(runtime="distributed", schedule="interleaved", partitions=4, checkpoint="never",
                     replicas=2)


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved"])
def test_two_cells_per_process_on_too_many_processes_are_told_the_partitions_to_pass(
        monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    """partitions=2 with a schedule of 2 cells per process on a 2-process job said "needs 1
    processes ... or pass replicas=2", which such a schedule refuses; it now says partitions=4."""
    class Job:
        world_size, rank = 2, 0

    class Plugin:
        @staticmethod
        def init_distributed() -> Job:
            return Job()

    monkeypatch.setattr("gpipe_repro.engine.placement.runtime_plugin", lambda runtime: Plugin)
    with pytest.raises(ValueError, match=r"puts 2 cells on each process, needs 1 processes but the job "
                                         r"has 2: pass partitions=4"):
        place_stages(runtime="distributed", schedule=schedule, partitions=2, checkpoint="never",
                     replicas=1)
