"""The benchmark harness in tiny modes: the rounds inside stage processes follow rank 0's stop rule
and every item runs once per round; bench-overhead runs end to end. No timing is judged."""
from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from gpipe_repro.report.measurement import Comparison, Measurement, StopRule


class Counter:
    def __init__(self) -> None:
        self.steps = 0

    def step(self, x: Any, y: Any) -> None:
        self.steps += 1


def _rounds(rule: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from gpipe_repro.distributed.process_group import init_distributed
    from gpipe_repro.repro.harness import rounds_in_processes

    rank = init_distributed().rank
    items = {"alone": Counter() if rank == 0 else None, "both": Counter()}
    result = rounds_in_processes(items, [Comparison("r", "alone", "both")], StopRule(**rule),
                                 torch.zeros(1), torch.zeros(1), warmup=1)
    dist.barrier()
    return {"result": result, "steps": {n: i.steps if i else None for n, i in items.items()}}


def test_rounds_in_stage_processes_stop_together_on_rank_0s_rule() -> None:
    from gpipe_repro.distributed import launch_local

    rule = {"min_rounds": 4, "max_rounds": 4, "budget_s": 600.0, "tolerance": 0.02}
    out = launch_local(_rounds, 2, rule, timeout=60)
    result = Measurement.from_json(out[0]["result"])
    assert out[1]["result"] is None and result.rounds == 4 and result.stopped == "max rounds"
    assert out[0]["steps"] == {"alone": 5, "both": 5} and out[1]["steps"] == {"alone": None, "both": 5}
    assert len(result.figures["r"].samples) == 4


def test_bench_overhead_runs_in_a_tiny_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from experiments import bench_overhead

    result = CliRunner().invoke(bench_overhead.app, ["--width", "16", "--depth", "1", "--batch", "8",
                                                     "--warmup", "1", "--min-rounds", "3", "--max-rounds",
                                                     "3", "--no-write"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "(n=3 rounds" in text and "not comparable" not in text
    assert "(<= 1.03)" in text            # the verdict against the target, whatever it is
