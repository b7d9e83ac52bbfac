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
