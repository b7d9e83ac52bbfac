"""Host probing: usable cores, how idle the host is, waiting for it to be idle."""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def host_idle_fraction(window: float = 1.0) -> float:
    """Share of the host's CPU time that was idle over the last `window` seconds (/proc/stat);
    1.0 where that cannot be read."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)      # idle + iowait, total
    try:
        idle0, total0 = sample()
        time.sleep(window)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return 1.0
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(timeout: float, threshold: float = 0.9) -> float:
    """Wait up to `timeout` seconds for the host to be idle (other processes would share the cores
    with the measurement, which no calibration can anticipate); return the last idle fraction."""
    deadline = time.monotonic() + timeout
    idle = host_idle_fraction()
    while idle < threshold and time.monotonic() < deadline:
        idle = host_idle_fraction()
    return idle




IDLE_CLEAN = 0.9
"""A measurement is *clean* when at least this share of the host's CPU time was idle in the second
before it (other processes would share the cores with it, which nothing downstream can correct)."""
BUSY_MARK = "†"


def conditions() -> dict[str, Any]:
    """The host's state just before a measurement: idle fraction over the last second, 1-minute load
    average, usable cores. Attach it to every measured number (see :func:`is_clean`)."""
    idle = host_idle_fraction()
    return {"idle_fraction_before": idle, "load_average_before": os.getloadavg()[0],
            "usable_cores": usable_cores()}


def is_clean(cond: Mapping[str, Any] | None) -> bool | None:
    """True/False for a measurement with recorded conditions; None where none were recorded (a
    result written before conditions were recorded: its cleanliness is unknown)."""
    if not cond or cond.get("idle_fraction_before") is None:
        return None
    idle = cond["idle_fraction_before"]
    assert isinstance(idle, (int, float))
    return idle >= IDLE_CLEAN


def busy_note(cond: Mapping[str, Any] | None) -> str:
    """"" for a clean measurement; otherwise the visible mark and why (for tables and captions)."""
    clean = is_clean(cond)
    if clean:
        return ""
    if clean is None:
        return f" {BUSY_MARK}(host state not recorded)"
    assert cond is not None
    return (f" {BUSY_MARK}busy (idle {float(cond['idle_fraction_before']):.0%}"
            f", load {float(cond.get('load_average_before') or 0.0):.1f})")
