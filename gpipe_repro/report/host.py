"""Host probing: usable cores, how idle the host is, waiting for it to be idle."""
from __future__ import annotations

import os
import time


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


