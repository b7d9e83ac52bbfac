"""report.host.HostWatch: a measurement is judged by what other processes did while it ran."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpipe_repro.report.host import OTHERS_CLEAN, HostWatch, busy_note, is_clean, others_cpu_ticks


def test_only_processes_outside_the_measurement_tree_count() -> None:
    # pid -> (ticks, parent): 10 is the measurement, 11 its stage process, 12 a grandchild that
    # appeared during it; 20 another user's job, 21 a job that started during the measurement.
    start = {1: (0, 0), 10: (100, 1), 11: (50, 10), 20: (1000, 1)}
    end = {1: (0, 0), 10: (400, 1), 11: (900, 10), 12: (300, 11), 20: (1250, 1), 21: (70, 1)}
    assert others_cpu_ticks(start, end, 10) == 250 + 70
    # a stage process reparented away from the tree at the end is still the measurement's own
    end_reparented = {**end, 11: (900, 1)}
    assert others_cpu_ticks(start, end_reparented, 10) == 250 + 70
    assert others_cpu_ticks(start, start, 10) == 0


def test_a_process_that_starts_during_the_measurement_makes_it_busy() -> None:
    # A process outside this one's tree (its parent shell exits at once, so it is reparented)
    # burns 1 s of CPU while the watch runs; the watch waits for it, so at least that much counts,
    # whatever else the host does. The measurement's own CPU (this loop) is not counted.
    hog = "import sys, time\nwhile time.process_time() < 1.0: pass\nopen(sys.argv[1], 'w').close()"
    done = Path(tempfile.gettempdir()) / f"gpipe-repro-hostwatch-{os.getpid()}-{time.monotonic_ns()}"
    with HostWatch() as host:
        subprocess.run(["sh", "-c", '"$@" &', "sh", sys.executable, "-c", hog, str(done)], check=True)
        bound = time.monotonic() + 300          # a hang bound, not a speed target
        while not done.exists():
            assert time.monotonic() < bound, "the CPU-burning process never finished"
            time.sleep(0.05)
    done.unlink()
    assert host.conditions["others_cpu_seconds_during"] >= 0.9
    if host.conditions["others_cpu_fraction_during"] > OTHERS_CLEAN:
        assert is_clean(host.conditions) is False
        assert "other processes" in busy_note(host.conditions)


def test_conditions_without_a_watch_are_judged_by_the_state_before() -> None:
    assert is_clean({"idle_fraction_before": 0.95}) is True
    assert is_clean({"idle_fraction_before": 0.95, "others_cpu_fraction_during": 0.3}) is False
    assert is_clean({"idle_fraction_before": 0.95, "others_cpu_fraction_during": 0.05}) is True
    assert is_clean({"idle_fraction_before": 0.5, "others_cpu_fraction_during": 0.0}) is False
    assert is_clean(None) is None


def test_a_host_that_slowed_down_is_not_clean() -> None:
    """A VM's cores can slow down with /proc showing nothing (report.host.speed_probe): a probe
    more than SPEED_CLEAN slower than the process's fastest, before or after, marks the
    measurement."""
    from gpipe_repro.report.host import SPEED_CLEAN, slowed_down
    quiet = {"idle_fraction_before": 1.0, "others_cpu_fraction_during": 0.0, "speed_fastest": 100.0}
    assert is_clean({**quiet, "speed_before": 95.0, "speed_after": 90.0}) is True
    slow_after = {**quiet, "speed_before": 97.0, "speed_after": 58.0}
    assert is_clean(slow_after) is False
    assert slowed_down(slow_after) == 1.0 - 58.0 / 100.0
    assert "42% slower than its fastest" in busy_note(slow_after)
    slow_before = {**quiet, "speed_before": 100.0 * (1 - SPEED_CLEAN) - 1.0}
    assert is_clean(slow_before) is False and slowed_down(slow_before) is not None
    # not probed (older results, or a test's fixed conditions): judged without it
    assert is_clean({"idle_fraction_before": 1.0}) is True and slowed_down({"speed_before": 1.0}) is None


def test_the_watch_probes_speed_before_and_after_when_the_conditions_do() -> None:
    from gpipe_repro.report.host import conditions, fastest_speed
    with HostWatch() as host:
        pass
    c = host.conditions
    assert c["speed_before"] > 0 and c["speed_after"] > 0
    assert c["speed_fastest"] == fastest_speed() >= max(c["speed_before"], c["speed_after"])
    with HostWatch(before=lambda: {"idle_fraction_before": 1.0}) as fixed:   # a test's fixed probe
        pass
    assert "speed_after" not in fixed.conditions
    assert set(conditions()) >= {"speed_before", "speed_fastest"}


def test_fast_share_is_the_share_of_chunks_near_the_fastest_seen(monkeypatch: Any) -> None:
    import gpipe_repro.report.host as host
    monkeypatch.setattr(host, "_cores", lambda: [None])
    monkeypatch.setattr(host, "_fastest_chunk", 1.0)           # 1 s per chunk is the fastest seen
    monkeypatch.setattr(host, "_chunk_seconds", lambda cpu, chunks, loop: [1.0, 2.0, 1.05, 2.1])
    assert host.fast_share() == 0.5
    monkeypatch.setattr(host, "_chunk_seconds", lambda cpu, chunks, loop: [0.5, 1.0, 1.0, 1.0])
    assert host.fast_share() == 0.25                           # a faster chunk raises the reference


def test_the_speed_probe_reads_every_core_and_reports_the_slowest(monkeypatch: Any) -> None:
    """A VM's vCPUs change speed independently (speed_probe's docstring), and a pipeline waits for
    its slowest stage: the probe runs on each usable core in turn, reports the slowest, raises the
    fastest seen by the fastest core, and gives the calling thread its affinity back."""
    import os

    import gpipe_repro.report.host as host
    pinned: list[int] = []
    monkeypatch.setattr(host, "_fastest", 0.0)
    monkeypatch.setattr(host, "_cores", lambda: [0, 1, 2])

    def probe_on(cpu: int | None, chunks: int, loop: int) -> float:
        assert cpu is not None
        pinned.append(cpu)
        return {0: 100.0, 1: 60.0, 2: 90.0}[cpu]
    monkeypatch.setattr(host, "_probe_on", probe_on)
    assert host.speed_probe() == 60.0 and host.fastest_speed() == 100.0 and pinned == [0, 1, 2]
    monkeypatch.undo()
    before = os.sched_getaffinity(0)
    assert host._probe_on(sorted(before)[0], 3, 1000) > 0
    assert os.sched_getaffinity(0) == before
