"""The host's link and the distributed runtime's own overheads, as the simulator takes them: each the
median over many steps and several pairs of processes, never one step's or one pair's reading."""
from __future__ import annotations

import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpipe_repro.engine.timeline import Event, Timeline
from gpipe_repro.sim import links
from gpipe_repro.sim.links import OVERHEAD_ROUNDS, OVERHEAD_STEPS, PING_ROUNDS, overheads_from_steps

MS = 1e-3


def step(setup: float, send: float, compute: float = 1 * MS) -> Timeline:
    """A K=2 step: stage 0 starts `setup` after the step's start, computes, sends (taking `send`);
    stage 1 receives it and computes."""
    f0 = Event(0, "forward", 0, setup, setup + compute)
    s0 = Event(0, "send_act", 0, f0.end, f0.end + send)
    r1 = Event(1, "recv_act", 0, setup, s0.end + 0.1 * MS, ready=f0.end)
    f1 = Event(1, "forward", 0, r1.end, r1.end + compute)
    return Timeline(2, [f0, s0, r1, f1])


def test_silent_runtime_overheads_were_read_off_one_step() -> None:
    # The setup of one tiny step on this host is 0.3 ms or 3-4 ms, and one step decided the
    # simulated setup: 0.5-4.2 ms between measurements, up to 4.4% on the throughput table's cells
    # with the same layer costs. Each overhead is the median over the steps.
    setups = [0.3, 3.8, 0.3, 4.1, 0.4, 3.9, 0.3]
    sends = [60, 90, 61, 70, 62, 65, 400]
    timelines = [step(s * MS, u * 1e-6) for s, u in zip(setups, sends)]
    times = [t.makespan + 0.02 * MS for t in timelines]
    found = overheads_from_steps(timelines, times, latency=0.05 * MS)
    assert found.setup == pytest.approx(statistics.median(setups) * MS)
    assert found.send == pytest.approx(statistics.median(sends) * 1e-6)
    assert found.teardown == pytest.approx(0.02 * MS)
    # the step whose time is the median one (what the measurement used to read) says otherwise
    closest = min(range(len(times)), key=lambda i: abs(times[i] - statistics.median(times)))
    assert (setups[closest] * MS, sends[closest] * 1e-6) != pytest.approx((found.setup, found.send))


def test_overheads_need_a_step_time_per_timeline() -> None:
    with pytest.raises(ValueError, match="one step time per timeline"):
        overheads_from_steps([step(MS, 1e-4)], [], latency=0.0)


def test_runtime_overheads_pool_every_step_of_every_pair_of_processes(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # each pair of processes is measured as one run; the figure pools the steps of all of them
    runs: list[list[float]] = [[0.3] * OVERHEAD_STEPS, [3.9] * OVERHEAD_STEPS]
    runs += [[0.3 + 0.1 * r] * OVERHEAD_STEPS for r in range(OVERHEAD_ROUNDS - 2)]
    calls: list[dict[str, Any]] = []

    def fake_measure(*args: Any, **kw: Any) -> SimpleNamespace:
        setups = runs[len(calls)]
        calls.append(kw)
        timelines = [step(s * MS, 1e-4) for s in setups]
        return SimpleNamespace(timelines=timelines, step_times=[t.makespan for t in timelines])

    monkeypatch.setattr("gpipe_repro.distributed.measure.measure_pipeline", fake_measure)
    monkeypatch.setattr(links, "measure_gloo_loopback",
                        lambda **kw: links.LinkModel("gloo-loopback", 5e-5, 1e9))
    found = links.measure_runtime_overheads(refresh=True, cache=tmp_path / "over.json")
    assert len(calls) == OVERHEAD_ROUNDS and all(c["steps"] == OVERHEAD_STEPS for c in calls)
    assert found.setup == pytest.approx(statistics.median(s for r in runs for s in r) * MS)
    assert f"{OVERHEAD_ROUNDS} runs of {OVERHEAD_STEPS} steps" in found.source
    # cached: read back, not measured again
    again = links.measure_runtime_overheads(cache=tmp_path / "over.json")
    assert again == found and len(calls) == OVERHEAD_ROUNDS


def test_gloo_link_is_the_median_over_pairs_of_processes(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    # one pair of processes read 197 us of latency where others read 109-123 us
    pairs = [{4: 197e-6, 1 << 20: 197e-6 + (1 << 20) / 3e9},
             {4: 115e-6, 1 << 20: 115e-6 + (1 << 20) / 3e9},
             {4: 120e-6, 1 << 20: 120e-6 + (1 << 20) / 3e9}]
    pairs += [pairs[1]] * (PING_ROUNDS - len(pairs))
    calls = iter(pairs)
    monkeypatch.setattr(links, "ping_pong", lambda: next(calls))
    link = links.measure_gloo_loopback(refresh=True, cache=tmp_path / "link.json")
    assert link.latency == pytest.approx(statistics.median(p[4] for p in pairs[:PING_ROUNDS]))
    assert link.bandwidth == pytest.approx(3e9, rel=0.05)
