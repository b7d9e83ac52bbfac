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
        self.frozen: list[int] = []     # objects out of the collector's sight at each step

    def step(self, x: Any, y: Any) -> None:
        import gc
        self.steps += 1
        self.frozen.append(gc.get_freeze_count())


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
    import gc
    return {"result": result, "steps": {n: i.steps if i else None for n, i in items.items()},
            "frozen": items["both"].frozen, "frozen_after": gc.get_freeze_count()}


def test_rounds_in_stage_processes_stop_together_on_rank_0s_rule() -> None:
    from gpipe_repro.distributed import launch_local

    rule = {"min_rounds": 4, "max_rounds": 4, "budget_s": 600.0, "tolerance": 0.02}
    out = launch_local(_rounds, 2, rule, timeout=60)
    result = Measurement.from_json(out[0]["result"])
    assert out[1]["result"] is None and result.rounds == 4 and result.stopped == "max rounds"
    assert out[0]["steps"] == {"alone": 5, "both": 5} and out[1]["steps"] == {"alone": None, "both": 5}
    assert len(result.figures["r"].samples) == 4
    # the start-up heap is collected and frozen after the warm-up, before the timed rounds
    for rank in out:
        assert rank["frozen"][0] == 0 and all(n > 0 for n in rank["frozen"][1:])
        assert rank["frozen_after"] == 0       # and unfrozen after, for the next group's items


def test_bench_overhead_runs_in_a_tiny_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from experiments import bench_overhead

    result = CliRunner().invoke(bench_overhead.app, ["--width", "16", "--depth", "1", "--batch", "8",
                                                     "--warmup", "1", "--min-rounds", "3", "--max-rounds",
                                                     "3", "--no-write"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "(n=3 rounds" in text and "not comparable" not in text
    assert "(<= 1.03)" in text            # the verdict against the target, whatever it is


# ----------------------------------------------------------------------------- publishing pages


def test_publish_refuses_a_file_it_did_not_write_before_any_work(tmp_path, monkeypatch) -> None:
    import json

    from gpipe_repro.repro.harness import check_publish, publish
    monkeypatch.setenv("GPIPE_REPRO_RESULTS", str(tmp_path))
    mine = tmp_path / "overhead" / "overhead.json"
    mine.parent.mkdir()
    mine.write_text('{"my": "notes"}')
    with pytest.raises(SystemExit, match="not a previous"):
        check_publish("overhead", "overhead", "bench-overhead")
    with pytest.raises(SystemExit):
        publish("overhead", "overhead", {"experiment": "x"}, "page", command="bench-overhead")
    assert json.loads(mine.read_text()) == {"my": "notes"}
    mine.unlink()
    publish("overhead", "overhead", {"experiment": "x"}, "page", command="bench-overhead")
    assert json.loads(mine.read_text())["written_by"] == "bench-overhead"
    check_publish("overhead", "overhead", "bench-overhead")          # its own: replaced
    with pytest.raises(SystemExit, match="not a previous"):
        check_publish("overhead", "overhead", "bench-compile")       # another command's


def test_publish_takes_its_unstamped_earlier_output_and_refuses_a_dirty_tree_of_record(
        tmp_path, monkeypatch) -> None:
    from gpipe_repro.report import output_guard, provenance
    from gpipe_repro.repro import harness
    monkeypatch.setenv("GPIPE_REPRO_RESULTS", str(tmp_path))
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "bench_runtime.json").write_text('{"experiment": "old", "method": "measured"}')
    (tmp_path / "runtime" / "bench_runtime.md").write_text("# old page")
    (tmp_path / "runtime" / "gantt_k2_m8_never.png").write_bytes(b"old chart")
    harness.check_publish("runtime", "bench_runtime", "bench-runtime", extra=("gantt_k2_m8_never.png",))
    monkeypatch.setattr(output_guard, "is_of_record", lambda path: True)
    monkeypatch.setattr(provenance, "changed_files", lambda repo=None: ["gpipe_repro/engine/gpipe.py"])
    with pytest.raises(SystemExit, match="only from a clean commit.*engine/gpipe.py"):
        harness.check_publish("runtime", "bench_runtime", "bench-runtime")
    harness.check_publish("runtime", "bench_runtime", "bench-runtime", write=False)
    # a checkout edited while the benchmark measured does not cost its measurements
    harness.publish("runtime", "bench_runtime", {"experiment": "new"}, "# page", command="bench-runtime")
    assert (tmp_path / "runtime" / "bench_runtime.md").read_text().startswith("# page")
