"""Interleaved 1F1B (Narayanan et al., SC'21): K processes, v = 2 cells (stages) each, round robin.
The schedule's stages are the K*v cells; `Schedule.processes` holds each process's program, which
the validator, the interpreter (validate, render, simulate) and the local runtime run as is."""
from __future__ import annotations

import pytest

from gpipe_repro.engine.interpreter import run_dataflow
from gpipe_repro.engine.schedule import ActionKind, Schedule, ScheduleError, make_schedule
from tests.engine.test_equivalence import MODELS, data
from tests.equivalence import assert_same_training, sgd_momentum


def span(schedule: Schedule, forward: float, backward: float) -> float:
    cost = {ActionKind.FORWARD: forward, ActionKind.BACKWARD: backward}
    return max(e.end for e in run_dataflow(schedule, lambda a: cost.get(a.kind, 0.0)))


@pytest.mark.parametrize("stages,m", [(2, 1), (2, 3), (4, 2), (4, 6), (8, 8), (8, 16), (6, 9)])
@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_interleaved_is_valid_round_trips_and_suits_in_order_backends(stages: int, m: int, mode: str) -> None:
    for ahead in (False, True):
        s = make_schedule("interleaved", stages, m, mode, ahead)
        s.validate()
        s.check_link_order()
        assert Schedule.from_text(s.to_text()) == s
        assert s.process_of() == [c % (stages // 2) for c in range(stages)]   # round robin


@pytest.mark.parametrize("k,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_interleaving_divides_the_bubble_by_v(k: int, m: int) -> None:
    # Narayanan et al. 2021, section 2.2.2: with v cells per process the bubble is (K-1)(t_f+t_b)/v.
    # A whole model costs F=1, B=2 per micro-batch and process share: each of the 2 cells half that.
    inter, plain = make_schedule("interleaved", 2 * k, m, "never"), make_schedule("1f1b", k, m, "never")
    assert span(plain, 1.0, 2.0) == 3 * m + 3 * (k - 1)
    assert span(inter, 0.5, 1.0) == 3 * m + 3 * (k - 1) / 2


def test_sizes_interleaving_cannot_serve_are_refused_with_what_to_use() -> None:
    with pytest.raises(ValueError, match=r"not a multiple of v=2; use partitions=2"):
        make_schedule("interleaved", 3, 4, "never")
    with pytest.raises(ValueError, match=r"M=3 is not a multiple of 2; use M=4"):
        make_schedule("interleaved", 4, 3, "never")


def test_interleaved_m_not_a_multiple_of_k_is_refused_at_construction() -> None:
    """Refused where the pipeline is built, before any step (and before a distributed job's
    process group)."""
    from torch import nn

    from gpipe_repro import GPipe
    with pytest.raises(ValueError, match=r"schedule='interleaved' with partitions=4 and micro_batches=3"):
        GPipe([nn.Linear(2, 2) for _ in range(4)], partitions=4, micro_batches=3, schedule="interleaved")


def test_process_programs_must_hold_each_stage_on_one_process_in_order() -> None:
    text = make_schedule("interleaved", 4, 2, "never").to_text()
    lines = text.splitlines()
    lines[1] = lines[1].replace("F0@0 sa0@0 F1@0", "F1@0 sa0@0 F0@0")
    with pytest.raises(ScheduleError, match=r"comes before|deadlocks|order"):
        Schedule.from_text("\n".join(lines)).validate()
    with pytest.raises(ScheduleError, match=r"needs its stage"):
        Schedule.from_text("schedule x stages=2 micro_batches=1 training=1 processes=1\nprocess 0: F0 B0")


def test_rendered_per_process_and_simulated_with_a_per_process_bubble() -> None:
    from gpipe_repro.sim.links import LinkModel
    from gpipe_repro.sim.simulator import PipelineCosts, simulate
    picture = make_schedule("interleaved", 4, 4, "never").render()
    assert picture.startswith("process 0 |F0@0") and "process 1 |" in picture and "stage" not in picture
    k, m = 2, 8
    half = [[0.5] * m for _ in range(2 * k)]
    one = [[1.0] * m for _ in range(2 * k)]
    none = [[0.0] * m for _ in range(2 * k - 1)]
    link = LinkModel("instant", latency=0.0, bandwidth=1.0)
    sim = simulate(make_schedule("interleaved", 2 * k, m, "never"),
                   PipelineCosts(half, half, half, one, [0.0] * (2 * k), none, none), link, batch_size=m)
    assert sim.step_time == 3 * m + 1.5 * (k - 1)
    assert sim.timeline.num_stages == k   # rows are processes
    assert sim.bubble_fraction == pytest.approx(1.5 * (k - 1) / (3 * m + 1.5 * (k - 1)))


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_interleaved_trains_equal_to_plain_training(kind: str, mode: str) -> None:
    build, loss_fn = MODELS[kind]
    batches = [data(kind, seed=3 + step) for step in range(2)]
    for stages, m in [(4, 4), (4, 6)]:
        assert_same_training(build(), None, None, loss_fn, partitions=stages, micro_batches=m,
                             checkpoint=mode, batches=batches, optimizer=sgd_momentum, atol=1e-5,
                             schedule="interleaved", recompute_ahead=m == 6)


def test_distributed_interleaved_refuses_replicas_before_starting_clearly() -> None:
    # (Interleaved on the distributed runtime is checked per parameter in
    # tests/distributed/test_equivalence.py; replicas of it are refused before any process group.)
    from gpipe_repro import GPipe
    build, loss_fn = MODELS["mlp"]
    with pytest.raises(ValueError, match=r"replicas=2.*not supported.*use replicas=1"):
        GPipe(build(), partitions=4, micro_batches=4, loss_fn=loss_fn, optimizer=None,
              schedule="interleaved", runtime="distributed", replicas=2)


def test_forward_on_processes_places_stages_in_order_and_refuses_training_schedules() -> None:
    from gpipe_repro.engine.schedule import forward_on_processes, gpipe_schedule, num_processes
    owner = make_schedule("interleaved", 4, 2, "never").process_of()
    s = forward_on_processes(gpipe_schedule(4, 2, training=False), owner)
    s.validate()
    assert s.process_of() == owner == [0, 1, 0, 1]
    assert [a.stage for a in s.programs()[0]] == [0] * 4 + [2] * 6   # F0 sa0 F1 sa1, then stage 2
    assert num_processes("interleaved", 4) == 2 and num_processes("1f1b", 4) == 4
    with pytest.raises(ValueError, match=r"places forward-only"):
        forward_on_processes(make_schedule("gpipe", 4, 2, "never"), owner)


def test_schedule_ablation_gives_throughput_beside_memory_for_every_schedule() -> None:
    from gpipe_repro.memory.schedule_ablation import schedule_ablation
    from gpipe_repro.sim.links import LinkModel
    from tests.memory.test_planner import _planner
    planner = _planner("transformer")
    rows = {r["schedule"]: r for r in schedule_ablation(
        planner, devices=2, micro_batches=8, link=LinkModel("instant", latency=0.0, bandwidth=1e12),
        flops_per_second=1e9)}
    assert set(rows) == {"gpipe", "1f1b", "zb-h1", "interleaved", "zb-v", "dualpipe-v"}
    assert all("note" not in r for r in rows.values()), rows
    assert rows["1f1b"]["max_activation_peak_bytes"] < rows["gpipe"]["max_activation_peak_bytes"]
    assert rows["zb-h1"]["throughput"] > rows["1f1b"]["throughput"]
    assert rows["interleaved"]["throughput"] > rows["1f1b"]["throughput"]
    assert rows["interleaved"]["cells"] == 4 and "walked together" in rows["interleaved"]["memory_note"]
    # DualPipeV: ZB-V's time on the same V, one chunk's activations more on a device (2K + 1 held)
    dual, zbv = rows["dualpipe-v"], rows["zb-v"]
    assert dual["balance"] == zbv["balance"] and dual["throughput"] == pytest.approx(zbv["throughput"])
    assert all(d >= z for d, z in zip(dual["activation_peak_bytes_per_device"],
                                      zbv["activation_peak_bytes_per_device"]))
    assert dual["activation_peak_bytes_per_device"] != zbv["activation_peak_bytes_per_device"]
    assert dual["max_activation_peak_bytes"] < rows["gpipe"]["max_activation_peak_bytes"]
    odd = schedule_ablation(planner, devices=2, micro_batches=3, link=LinkModel("i", 0.0, 1e12),
                            flops_per_second=1e9, schedules=["interleaved"])
    assert "not a multiple" in odd[0]["note"]
