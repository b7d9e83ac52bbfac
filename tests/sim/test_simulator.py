"""The pipeline simulator against closed forms: fill-drain makespan, bubble, link latency and
bandwidth, link serialization, recompute-ahead, and the schedule it consumes being the runtimes'."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe_repro.engine.schedule import ActionKind, make_schedule
from gpipe_repro.sim.calibration import Calibration, LayerCost
from gpipe_repro.sim.links import PRESETS, LinkModel, fit_alpha_beta, get_link
from gpipe_repro.sim.simulator import (
    PipelineCosts,
    replay_costs,
    simulate,
    simulate_config,
    stage_costs,
    theoretical_bubble,
)

IDEAL = PRESETS["ideal"]


def uniform(k: int, m: int, f: float = 1.0, b: float = 2.0, r: float = 1.0, opt: float = 0.0,
            nbytes: float = 0.0) -> PipelineCosts:
    return PipelineCosts(forward=[[f] * m] * k, forward_nograd=[[f] * m] * k,
                         recompute=[[r] * m] * k, backward=[[b] * m] * k, optimizer=[opt] * k,
                         boundary_bytes=[[nbytes] * m] * (k - 1), grad_bytes=[[nbytes] * m] * (k - 1))


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 6), m=st.integers(1, 12))
def test_fill_drain_makespan_and_bubble_match_the_paper(k: int, m: int) -> None:
    sim = simulate(make_schedule("gpipe", k, m, "never"), uniform(k, m), IDEAL, batch_size=m)
    assert sim.step_time == pytest.approx(3 * (m + k - 1))
    assert sim.bubble_fraction == pytest.approx(theoretical_bubble(k, m))
    assert sum(sim.breakdown.values()) == pytest.approx(1.0)
    assert sim.throughput == pytest.approx(m / (3 * (m + k - 1)))
    assert sim.utilization == pytest.approx([3 * m / (3 * (m + k - 1))] * k)


@pytest.mark.parametrize("k,m", [(2, 1), (3, 4), (4, 8)])
def test_one_f_one_b_has_the_same_makespan_as_gpipe_with_uniform_costs(k: int, m: int) -> None:
    costs = uniform(k, m)
    gpipe = simulate(make_schedule("gpipe", k, m, "never"), costs, IDEAL, m)
    ofob = simulate(make_schedule("1f1b", k, m, "never"), costs, IDEAL, m)
    assert ofob.step_time == pytest.approx(gpipe.step_time)


@pytest.mark.parametrize("latency", [0.1, 0.5])
def test_latency_delays_the_fill_and_the_drain_once_per_hop(latency: float) -> None:
    k, m = 4, 6
    link = LinkModel("test", latency, float("inf"))
    sim = simulate(make_schedule("gpipe", k, m, "never"), uniform(k, m), link, m)
    assert sim.step_time == pytest.approx(3 * (m + k - 1) + 2 * (k - 1) * latency)
    assert sim.breakdown["communication"] > 0


def test_bandwidth_counts_bytes_and_a_slow_link_becomes_the_bottleneck() -> None:
    k, m = 2, 8
    fast = simulate(make_schedule("gpipe", k, m, "never"), uniform(k, m, nbytes=100.0),
                    LinkModel("bw", 0.0, 1000.0), m)   # 0.1 s per transfer: hidden behind compute
    assert fast.step_time == pytest.approx(3 * (m + k - 1) + 2 * 0.1)
    slow = simulate(make_schedule("gpipe", k, m, "never"), uniform(k, m, nbytes=5000.0),
                    LinkModel("bw", 0.0, 1000.0), m)   # 5 s per transfer, one at a time per link
    # The forward wave is limited by the link: the last activation arrives after m transfers.
    assert slow.step_time >= m * 5.0 + 1.0 + m * 2.0
    assert slow.throughput < fast.throughput / 2


def test_send_and_receive_overheads_occupy_the_stages() -> None:
    # K=2, M=3, F=1, B=2, sends 0.25 and receives 0.5 on the stage, instant link. By hand: stage 1
    # finishes its last send of a gradient at 12.5; stage 0 then receives (0.5) and runs B0 (2).
    link = LinkModel("cpu", 0.0, float("inf"), send_overhead=0.25, recv_overhead=0.5)
    sim = simulate(make_schedule("gpipe", 2, 3, "never"), uniform(2, 3), link, 3)
    assert sim.step_time == pytest.approx(15.5)
    stage0 = sim.timeline.busy(0)
    assert stage0["computation"] == pytest.approx(9.0)


def test_recompute_ahead_overlaps_the_wait_for_gradients() -> None:
    k, m = 4, 4
    costs = uniform(k, m, r=1.0)
    late = simulate(make_schedule("gpipe", k, m, "always", recompute_ahead=False), costs, IDEAL, m)
    ahead = simulate(make_schedule("gpipe", k, m, "always", recompute_ahead=True), costs, IDEAL, m)
    # Without ahead: every micro-batch pays F + R + B = 4 on the critical path.
    assert late.step_time == pytest.approx(4 * (m + k - 1))
    assert ahead.step_time < late.step_time
    # The same recompute work, only placed earlier.
    assert (late.breakdown["re-computation"] * late.step_time
            == pytest.approx(ahead.breakdown["re-computation"] * ahead.step_time))


def test_the_timeline_follows_the_schedule_the_runtimes_execute() -> None:
    sched = make_schedule("gpipe", 3, 5, "except_last", recompute_ahead=True)
    sim = simulate(sched, uniform(3, 5, opt=0.5, nbytes=10.0), LinkModel("l", 0.01, 1e4), 5)
    for s, actions in enumerate(sched.stages):
        events = sim.timeline.stage_events(s)
        assert [(e.kind, e.microbatch) for e in events] == [(a.kind.value, a.microbatch) for a in actions]
        for a, b in zip(events, events[1:]):
            assert a.end <= b.start + 1e-12          # one action at a time per stage
    recvs = [e for e in sim.timeline.events if e.kind in ("recv_act", "recv_grad")]
    assert all(e.ready is not None and e.ready <= e.end for e in recvs)
    # A checkpointed micro-batch's forward costs forward_nograd; the last one's, forward.
    assert sum(e.kind == ActionKind.RECOMPUTE.value for e in sim.timeline.events) == 3 * 4


def calibration(per_layer: list[tuple[float, float, float, float]], size: int = 2,
                out_bytes: int = 64) -> Calibration:
    costs = [LayerCost(forward=f, forward_nograd=f * 0.9, recompute=r, backward=b, optimizer=o,
                       forward_flops=1.0, flops=3.0, params=1, output_bytes=out_bytes * (i + 1),
                       grad_bytes=out_bytes * (i + 1))
             for i, (f, r, b, o) in enumerate(per_layer)]
    return Calibration("test", "time", "test", list(range(len(costs))), {size: costs},
                       optimizer_call=0.01)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved"])
def test_every_backward_but_a_stages_first_adds_into_existing_gradients(schedule: str) -> None:
    """The stage executor sets p.grad to None at the start of a step: the first action writing a
    stage's parameter gradients writes fresh ones, the others add into them (calibrated
    `accumulate`). Removing the term, or charging it to the first backward, changes every duration."""
    layers = [(1.0, 1.0, 2.0, 0.0)] * 4
    cal = calibration(layers)
    acc = 0.25
    cal.costs[2] = [dataclasses.replace(c, accumulate=acc) for c in cal.costs[2]]
    k = 2
    sim = simulate_config(cal, [2, 2], 4, 8, get_link("ideal"), checkpoint="never", schedule=schedule)
    plain = simulate_config(calibration(layers), [2, 2], 4, 8, get_link("ideal"), checkpoint="never",
                            schedule=schedule)
    writers = ("backward", "backward_weight")
    for s in range(k):
        got = [e.end - e.start for e in sim.timeline.events if e.stage == s and e.kind in writers]
        base = [e.end - e.start for e in plain.timeline.events if e.stage == s and e.kind in writers]
        if schedule == "interleaved":      # one process runs both cells: one fresh backward each
            assert sorted(g - b for g, b in zip(got, base)) == pytest.approx(
                [0.0] * 2 + [2 * acc] * 6 if s == 0 else [])
            continue
        assert got[0] == pytest.approx(base[0])                         # fresh gradients
        assert [g - b for g, b in zip(got[1:], base[1:])] == pytest.approx([2 * acc] * 3)
    assert sim.step_time > plain.step_time


def test_a_measured_zero_bubble_split_is_what_the_simulator_charges() -> None:
    """Calibrated BACKWARD_INPUT / BACKWARD_WEIGHT (the split costs more than one backward: two graph
    walks and PyTorch's graph analysis) replace the half-and-half rule; W was timed into existing
    gradients, so a stage's first W (fresh gradients) is cheaper by the accumulation."""
    cal = calibration([(1.0, 1.0, 2.0, 0.0)] * 4)
    cal.costs[2] = [dataclasses.replace(c, accumulate=0.25, backward_input=1.5, backward_weight=2.0)
                    for c in cal.costs[2]]
    sim = simulate_config(cal, [2, 2], 4, 8, get_link("ideal"), checkpoint="never", schedule="zb-h1")

    def seconds(stage: int, kind: str) -> list[float]:
        return [e.end - e.start for e in sim.timeline.events if e.stage == stage and e.kind == kind]

    assert seconds(1, "backward_input") == pytest.approx([2 * 1.5] * 4)
    assert seconds(1, "backward_weight") == pytest.approx([2 * (2.0 - 0.25)] + [2 * 2.0] * 3)
    # stage 0 sends no input gradient: its I does nothing, its W is its whole (plain) backward
    assert seconds(0, "backward_input") == pytest.approx([0.0] * 4)
    assert seconds(0, "backward_weight") == pytest.approx([2 * 2.0] + [2 * (2.0 + 0.25)] * 3)


def test_stage_costs_sum_each_cell_and_take_the_cut_layer_bytes() -> None:
    cal = calibration([(1.0, 1.0, 2.0, 0.1), (2.0, 2.0, 4.0, 0.2), (3.0, 3.0, 6.0, 0.3)])
    costs = stage_costs(cal, [1, 2], [2, 2, 2])
    assert costs.forward == [[1.0] * 3, [5.0] * 3]
    assert costs.forward_nograd[1] == pytest.approx([4.5] * 3)
    assert costs.backward == [[2.0] * 3, [10.0] * 3]
    assert costs.optimizer == pytest.approx([0.11, 0.51])
    assert costs.boundary_bytes == [[64.0] * 3]
    with pytest.raises(KeyError, match="micro-batch size 3"):
        stage_costs(cal, [1, 2], [3, 3])
    with pytest.raises(ValueError, match="sums to"):
        stage_costs(cal, [1, 1], [2])


def test_simulate_config_splits_the_batch_like_the_runtime() -> None:
    cal = calibration([(1.0, 1.0, 2.0, 0.0)] * 4)
    sim = simulate_config(cal, [2, 2], 4, 8, IDEAL, checkpoint="never")
    assert sim.batch_size == 8
    assert sim.step_time == pytest.approx(3 * 2 * (4 + 1) + 0.01)   # 2 layers per cell, + opt call


def test_alpha_beta_fit_recovers_latency_and_bandwidth() -> None:
    sizes = [4, 4096, 65536, 1 << 20, 8 << 20]
    latency, bandwidth = fit_alpha_beta(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert latency == pytest.approx(50e-6, rel=1e-3)
    assert bandwidth == pytest.approx(2e9, rel=1e-6)


def test_link_presets_and_their_costs() -> None:
    pcie = get_link("pcie")
    assert pcie.transfer_time(10e9) == pytest.approx(1.0 + 10e-6)
    assert IDEAL.transfer_time(1e12) == 0.0
    assert math.isclose(get_link("nvlink").bandwidth / pcie.bandwidth, 10.0)
    with pytest.raises(ValueError, match="unknown link"):
        get_link("carrier-pigeon")


def test_replaying_a_timeline_reproduces_its_step() -> None:
    sched = make_schedule("gpipe", 3, 4, "always", recompute_ahead=False)
    costs = PipelineCosts(forward=[[1.0, 1.5, 1.0, 2.0]] * 3, forward_nograd=[[0.8, 1.2, 0.8, 1.6]] * 3,
                          recompute=[[1.0, 1.5, 1.0, 2.0]] * 3, backward=[[2.0, 3.0, 2.0, 4.0]] * 3,
                          optimizer=[0.3, 0.2, 0.1], boundary_bytes=[[100.0] * 4] * 2,
                          grad_bytes=[[100.0] * 4] * 2, setup=0.05, teardown=0.07)
    link = LinkModel("l", 0.01, 1e4, send_overhead=0.002, recv_overhead=0.001)
    original = simulate(sched, costs, link, 4)
    replayed = simulate(sched, replay_costs(original.timeline, original.step_time, [100.0, 100.0]),
                        link, 4)
    assert replayed.step_time == pytest.approx(original.step_time)
    assert replayed.breakdown == pytest.approx(original.breakdown)


def test_the_throughput_table_end_to_end_on_synthetic_costs(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    """The sweep's orchestration, normalization, labels and outputs, with costs made up (uniform
    layers) instead of timed, a free link and a fake 'measured' run 10% slower than simulated."""
    from gpipe_repro.repro import throughput as tp

    def fake_calibrate(workload: Any, sizes: list[int], **kw: Any) -> Calibration:
        n = 26 if "amoeba" in workload.family else 50
        per = {b: [LayerCost(forward=1e-3 * b, forward_nograd=1e-3 * b, recompute=1e-3 * b,
                             backward=2e-3 * b, optimizer=1e-5, forward_flops=1.0, flops=3.0,
                             params=1, output_bytes=100 * b, grad_bytes=100 * b)] * n for b in sizes}
        return Calibration(workload.name, "time", "synthetic", [0] * n, per,
                           uncertainty={b: 0.01 for b in sizes})

    def fake_measure(workload: Any, balance: list[int], m: int, n: int, checkpoint: str) -> dict:
        cal = fake_calibrate(workload, [n // m])
        sim = simulate_config(cal, balance, m, n, IDEAL, checkpoint=checkpoint, recompute_ahead=False)
        return {"step_time_s": sim.step_time * 1.1, "step_times": [sim.step_time * 1.1],
                "timeline": sim.timeline}

    from gpipe_repro.repro.throughput import measure, rows, settings, table
    monkeypatch.setattr(table, "calibrate", fake_calibrate)
    monkeypatch.setattr(rows, "calibrate", fake_calibrate)
    monkeypatch.setattr(measure, "usable_cores", lambda: 2)
    monkeypatch.setattr(settings, "usable_cores", lambda: 2)
    # the measured cells' rounds: a few (each round runs every measured cell once)
    monkeypatch.setattr(measure, "CELL_RULE", measure.StopRule(min_rounds=3, max_rounds=3))
    # The schedule ablation plans the paper-size models (minutes); its rows are tested at toy scale
    # in tests/repro/test_throughput_schedules.py. Here: that the sweep runs it and the page shows it.
    ablated: list[str] = []

    def fake_schedule_rows(model: str, *args: Any, **kw: Any) -> list[dict[str, Any]]:
        ablated.append(model)
        return [{"workload": model, "costs": "flop model", "micro_batches": 8, "schedule": "1f1b",
                 "devices": 8, "cells": 8, "throughput": 1.0, "bubble": 0.5, "max_peak_bytes": 1 << 30,
                 "max_activation_peak_bytes": 1 << 29}]
    monkeypatch.setattr(table, "schedule_ablation_rows", fake_schedule_rows)
    monkeypatch.setattr(table, "link_control", lambda: {"tpu-ici": {"gpipe": 2.0, "1f1b": 1.0},
                                                        "free": {"gpipe": 2.0, "1f1b": 3.0}})
    settings = tp.SweepSettings(link="ideal", measure=True)
    payload = tp.run_throughput_table(settings, measure=fake_measure)
    assert sorted(ablated) == ["amoebanet", "transformer"]
    assert set(payload["schedule_ablation"]) == set(ablated)
    assert payload["schedule_link_control"]["method"] == "simulated"    # a record says what it is
    t2 = {(r["K"], r["M"]): r for r in payload["table2"]["transformer"]}
    assert t2[(2, 1)]["simulated"]["normalized"] == 1.0
    # Normalized = (N / step) over the K=2, M=1 row's; the micro-batch stays 4, so N = 4 M.
    step = {key: r["simulated"]["step_time_s"] for key, r in t2.items()}
    assert t2[(8, 32)]["simulated"]["normalized"] == pytest.approx(32 * step[(2, 1)] / step[(8, 32)])
    assert t2[(8, 32)]["batch"] == 128 and t2[(8, 32)]["microbatch"] == 4
    assert 5.5 < t2[(8, 32)]["simulated"]["normalized"] < 32 * 8 / (32 + 7) / (32 / 33) * 1.0
    assert t2[(2, 4)]["measured"]["normalized"] == pytest.approx(t2[(2, 4)]["simulated"]["normalized"])
    assert t2[(4, 4)]["measured"] is None                      # K=4 > 2 cores: simulated only
    assert t2[(8, 32)]["paper"] == 6.3 and payload["table2"]["amoebanet"][-1]["torchgpipe"] == 4.953
    assert {c["model"] for c in payload["claims"]} == {"transformer", "amoebanet"}
    files = tp.write_outputs(payload, tmp_path, log_wandb=False)
    names = {f.name for f in files}
    assert {"throughput_table.json", "throughput_table.md", "speedup.png", "bubble.png"} <= names
    md = (tmp_path / "throughput_table.md").read_text()
    assert "Where `gpipe` beats `1f1b`, the link does" in md
    assert "measured 1.00" in md and "paper 6.30" in md and "torchgpipe 4.95" in md
    assert "`bottleneck`" in md and "policy `micro`" in md
    assert "throughput beside memory at K=8" in md
    # a table written when the calibration's host state was recorded still shows it
    quiet = {**payload, "host": {"idle_fraction_before": 0.95, "load_average_before": 0.2,
                                 "others_cpu_fraction_during": 0.0, "clean": True}}
    assert "calibration ran on a busy host" not in tp.render_markdown(quiet)
    busy = {**payload, "host": {"idle_fraction_before": 0.4, "load_average_before": 1.2,
                                "others_cpu_fraction_during": 0.5, "clean": False}}
    assert ("**The calibration ran on a busy host** (idle 40%, load 1.2, other processes 50% of the "
            "CPU during): per-layer costs") in tp.render_markdown(busy)
    # A rerun keeps the cuts of the table it replaces where they are among its ties (uniform layers:
    # every cut with the fewest layers in its largest cell ties), and says so; a cut of another
    # model's layer count is chosen afresh.
    earlier = json.loads(json.dumps(payload))
    a8 = next(r for r in earlier["table2"]["amoebanet"] if (r["K"], r["M"]) == (8, 32))
    alternative = sorted(a8["balance"], reverse=True)
    assert alternative != a8["balance"]
    a8["balance"] = alternative
    t2 = next(r for r in earlier["table2"]["transformer"] if (r["K"], r["M"]) == (2, 4))
    t2["balance"] = [24, 24]
    rerun = tp.run_throughput_table(dataclasses.replace(settings, measure=False), previous=earlier)
    again = {(r["K"], r["M"]): r for r in rerun["table2"]["amoebanet"]}
    assert again[(8, 32)]["balance"] == alternative and again[(8, 32)]["cut_kept"]
    assert all(r["cut_kept"] for r in again.values())
    t2_again = next(r for r in rerun["table2"]["transformer"] if (r["K"], r["M"]) == (2, 4))
    assert t2_again["balance"] == [25, 25] and not t2_again["cut_kept"]


# ----------------------------------------------------------------------------- your own model

OWN_MLP = ("from torch import nn\n"
           "def mlp(width=32, depth=4):\n"
           "    layers = [nn.Linear(16, width), nn.ReLU()]\n"
           "    for _ in range(depth):\n"
           "        layers += [nn.Linear(width, width), nn.ReLU()]\n"
           "    return nn.Sequential(*layers, nn.Linear(width, 5))\n")


def _own_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str = OWN_MLP,
                module: str = "own_models_for_test") -> str:
    """A user's model module `module` holding `source` (its factory `mlp`), importable, with the
    calibration cache in `tmp_path`; returns the factory's spec."""
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("GPIPE_REPRO_CACHE", str(tmp_path / "cache"))
    return f"{module}:mlp"


def test_simulate_your_own_model_from_a_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_repro.models.workload import Workload
    from gpipe_repro.sim.own_model import simulate_model

    spec = _own_module(tmp_path, monkeypatch)
    work = Workload.create("own MLP", spec, "features", (16,), 5, width=64)
    assert len(work.build("meta")) == 11
    r = simulate_model(work, k=2, m=4, microbatch=8, method="flops", link="ideal", validate=False)
    assert (r.K, r.M, r.checkpoint, r.recompute_ahead) == (2, 4, "except_last", False)  # GPipe's
    assert sum(r.balance) == 11 and r.step_time_s > 0 and r.measured_step_time_s is None
    # The speedup from the calibrated FLOP costs by the closed form of a 2-stage fill-drain (GPipe,
    # Huang et al. 2019, sec. 2.3: M + K - 1 forward slots, bubble O((K-1)/(M+K-1))), computed here
    # without the simulator: per-cell forward F_s, recompute R_s, backward B_s, optimizer O_s.
    from gpipe_repro.sim.calibration import calibrate
    calib = calibrate(work, [8, 32], method="flops")
    layer, whole_batch = calib.at(8), calib.at(32)
    cells = [layer[:r.balance[0]], layer[r.balance[0]:]]
    assert all(c.forward_nograd == c.forward for c in layer)      # one forward cost per micro-batch
    f0, f1 = (sum(c.forward for c in cell) for cell in cells)
    r0, r1 = (sum(c.recompute for c in cell) for cell in cells)
    b0, b1 = (sum(c.backward for c in cell) for cell in cells)
    opt = calib.optimizer_call + max(sum(c.optimizer for c in cell) for cell in cells)
    m = 4
    fwd_end = f0 + f1 + (m - 1) * max(f0, f1)                    # two-machine flow shop
    # Stage 1: B of the last micro-batch (kept: except_last), then R + B for each earlier one; each
    # gradient goes to stage 0 at once (free link), which recomputes after it arrives.
    grad_at = [fwd_end + b1 + (m - 1 - j) * (r1 + b1) for j in range(m)]
    end0 = grad_at[m - 1] + b0
    for j in range(m - 2, -1, -1):
        end0 = max(end0, grad_at[j]) + r0 + b0
    step = max(end0, grad_at[0]) + opt                           # AGREE, then the updates
    # the reference: one device, one micro-batch of all N = 32 examples, no re-materialization
    whole = sum(c.forward + c.backward + c.optimizer for c in whole_batch) + calib.optimizer_call
    assert r.speedup == pytest.approx(whole / step, rel=1e-9)
    assert "speedup" in r.describe()
    with pytest.raises(ValueError, match="takes no option colour"):
        Workload.create("bad", spec, "features", (16,), 5, colour=1)
    with pytest.raises(ValueError, match="cannot import"):
        Workload.create("bad", "no_such_module_xyz:f", "features", (16,), 5)
    with pytest.raises(ValueError, match="k <= 11"):
        simulate_model(work, k=12, m=1, microbatch=8, method="flops", validate=False)


def test_the_own_model_command_line_checks_its_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from typer.testing import CliRunner

    from gpipe_repro.cli import app
    from gpipe_repro.repro import simulate_model

    spec = _own_module(tmp_path, monkeypatch)
    seen: list[Any] = []
    monkeypatch.setattr(simulate_model, "main", lambda work, **kw: seen.append((work, kw)))
    own = ["throughput", "--model", spec, "--input-shape", "16", "--k", "2", "--m", "4"]
    result = CliRunner().invoke(app, [*own, "--classes", "5", "--option", "width=48"])
    assert result.exit_code == 0, result.output
    work, kw = seen[0]
    assert dict(work.options) == {"width": 48} and kw["checkpoint"] == "except_last"
    result = CliRunner().invoke(app, [*own, "--option", "width"])
    assert result.exit_code == 2 and "--option takes KEY=VALUE" in result.output
    monkeypatch.undo()
    spec = _own_module(tmp_path, monkeypatch)
    result = CliRunner().invoke(app, ["throughput", "--model", spec, "--input-shape", "16", "--classes", "5",
                                      "--k", "2", "--m", "4", "--method", "flops", "--link", "ideal",
                                      "--no-validate"])
    assert result.exit_code == 0 and "simulated step" in result.output, result.output


def test_simulate_config_defaults_are_gpipes() -> None:
    import inspect

    from gpipe_repro import GPipe

    sim = inspect.signature(simulate_config).parameters
    eng = inspect.signature(GPipe).parameters
    for name in ("checkpoint", "recompute_ahead"):
        assert sim[name].default == eng[name].default


def test_validate_sim_takes_every_k_up_to_the_usable_cores() -> None:
    from gpipe_repro.repro.throughput.validation import unvalidated_note, validation_ks

    assert validation_ks(1) == [] and validation_ks(2) == [2] and validation_ks(3) == [2]
    assert validation_ks(4) == [2, 4] and validation_ks(64) == [2, 4, 8]
    assert "K = 4, 8 not validated here" in unvalidated_note([2], 2)
    assert unvalidated_note([2, 4, 8], 8) == ""


def test_silent_unvalidated_note_blamed_cores_for_k_not_asked() -> None:
    """A K=4-only validation on 16 cores said K = 2, 8 could not run for want of cores."""
    from gpipe_repro.repro.throughput.validation import unvalidated_note

    note = unvalidated_note([4], 16)
    assert "not validated here" not in note and "usable core(s), so" not in note
    assert "K = 2, 8 not run in this validation" in note
    mixed = unvalidated_note([2], 4)
    assert "K = 8 not validated here" in mixed and "K = 4 not run" in mixed


# ----------------------------------------------------------------------------- reproducible partitions

def test_two_tables_are_compared_cell_by_cell_and_partition_by_partition() -> None:
    from experiments.compare_throughput import compare, render

    def table(x: float, balance: list[int]) -> dict[str, Any]:
        return {"table2": {"transformer": [
            {"K": 2, "M": 1, "balance": [2, 2], "simulated": {"normalized": 1.0}},
            {"K": 8, "M": 32, "balance": balance, "simulated": {"normalized": x}}]}}

    same = compare(table(5.0, [1] * 8), table(5.05, [1] * 8))
    assert same["max_abs_difference"] == pytest.approx(0.01) and same["partitions_agree"]
    assert "**met**" in render(same, "a", "b", "idle")
    moved = compare(table(6.36, [4, 4, 3, 2, 2, 2, 3, 4]), table(5.57, [4, 3, 3, 3, 3, 2, 2, 4]))
    assert not moved["partitions_agree"] and "NOT met" in render(moved, "a", "b", "busy")
    # the page says the cells are simulated, and from what each run's costs came
    recorded = {**table(5.0, [1] * 8), "environment": {"device": "Intel Xeon", "git_commit": "abcdef12"},
                "calibration": {"transformer": {"method": "time", "device": "cpu: Intel Xeon, 1 thread"}}}
    page = render(compare(recorded, table(5.0, [1] * 8)), "a", "b", "idle")
    assert "Every cell is simulated" in page
    assert "Run A: host Intel Xeon, commit abcdef1, costs: transformer time on cpu: Intel Xeon" in page
    assert "Run B: not recorded" in page


def test_own_model_k1_is_its_own_baseline_and_in_place_layers_are_timed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """K=1 in one process pays no stage processes' per-step costs: it is 1.00x of one device (it
    read 0.22x on the default link). A model with ReLU(inplace=True) is timed as the executor runs
    it (a copy of the input it modifies), not refused by autograd."""
    from gpipe_repro.models.workload import Workload
    from gpipe_repro.sim.own_model import simulate_model
    spec = _own_module(tmp_path, monkeypatch, module="inplace_models_for_test", source=(
        "from torch import nn\n"
        "def mlp():\n"
        "    return [nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 32), nn.ReLU(inplace=True),\n"
        "            nn.Linear(32, 5)]\n"))
    work = Workload.create("in-place MLP", spec, "features", (16,), 5)
    one = simulate_model(work, k=1, m=1, microbatch=8, checkpoint="never", validate=False, repeats=3)
    assert one.speedup == pytest.approx(1.0)
    two = simulate_model(work, k=2, m=2, microbatch=8, validate=False, repeats=3)
    assert two.step_time_s > 0


def test_a_model_file_in_the_current_directory_is_found(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The gpipe-repro command does not put the current directory on the path (python -m does);
    a user's model file usually sits there."""
    import sys

    from gpipe_repro.models.workload import Workload
    (tmp_path / "here_model_for_test.py").write_text(
        "from torch import nn\ndef mlp():\n    return [nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 5)]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    work = Workload.create("here", "here_model_for_test:mlp", "features", (16,), 5)
    assert len(work.build("meta")) == 3


def test_replaying_an_interleaved_timeline_reproduces_its_step() -> None:
    """A process of an interleaved (or V) schedule runs several cells; the replay reads each cell's
    durations off its events' cells, so a simulated step replays to itself, cell by cell."""
    for name in ("interleaved", "zb-v"):
        sched = make_schedule(name, 4, 4, "never", recompute_ahead=False)
        per_cell = [[1.0, 1.5, 1.0, 2.0], [0.5, 0.7, 0.5, 0.9], [2.0, 2.5, 2.0, 3.0], [1.0] * 4]
        costs = PipelineCosts(forward=per_cell, forward_nograd=per_cell, recompute=per_cell,
                              backward=[[2 * t for t in row] for row in per_cell],
                              optimizer=[0.3, 0.2, 0.1, 0.4], boundary_bytes=[[100.0] * 4] * 3,
                              grad_bytes=[[100.0] * 4] * 3, setup=0.05, teardown=0.07)
        link = LinkModel("l", 0.01, 1e4, send_overhead=0.002, recv_overhead=0.001)
        original = simulate(sched, costs, link, 4)
        assert original.timeline.num_stages == 2
        assert {e.cell for e in original.timeline.events} == {0, 1, 2, 3}
        replayed = simulate(sched, replay_costs(original.timeline, original.step_time, [100.0] * 3),
                            link, 4)
        assert replayed.step_time == pytest.approx(original.step_time), name
