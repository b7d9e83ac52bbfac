"""Host probing: usable cores, how idle the host is, how fast it runs right now."""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
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


IDLE_CLEAN = 0.9
"""A measurement is *clean* when at least this share of the host's CPU time was idle in the second
before it (other processes would share the cores with it, which nothing downstream can correct)."""
BUSY_MARK = "†"


def conditions() -> dict[str, Any]:
    """The host's state just before a measurement: idle fraction over the last second, 1-minute load
    average, usable cores, and how fast the host runs right now (:func:`speed_probe`, against the
    fastest probe of this process). Attach it to every measured number (see :func:`is_clean`)."""
    idle = host_idle_fraction()
    speed = speed_probe()
    return {"idle_fraction_before": idle, "load_average_before": os.getloadavg()[0],
            "usable_cores": usable_cores(), "speed_before": speed, "speed_fastest": fastest_speed()}


SPEED_CLEAN = 0.15
"""A measurement is *clean* only if the host ran the speed probe at no less than ``1 - SPEED_CLEAN``
of the fastest this process has seen, before and after it (see :func:`speed_probe`)."""

_fastest = 0.0


def speed_probe(chunks: int = 7, loop: int = 20_000) -> float:
    """How fast this host runs a fixed piece of work right now, on its slowest usable core: loops
    per second of a pure-Python loop, the median of `chunks` runs (about 5 ms per core), run on each
    core in turn (the calling thread pinned to it, then given its affinity back). Also raises
    :func:`fastest_speed` (the fastest reading of any core).

    Why: a virtual machine's cores can slow down with nothing in the guest to show it (no load, no
    other process, no steal time): a neighbour on the physical core's other hyperthread, or the
    package's clock. On a 2-core VM the host alternated, every few seconds to tens
    of seconds, between two states; this probe read 0.75-0.8 ms in one and 1.35-1.4 ms in the other,
    while a Transformer layer's forward and backward took 11-12 ms and 16-17 ms. /proc showed
    the host idle throughout. A measurement taken in the slow state, or across a change of state,
    is not comparable with a calibration taken in the fast one.

    Why every core: on the same VM the next day, probing both vCPUs at once every 0.1 s for 25 s,
    each was fast 37-39% of the time and the two agreed on their state only 56% of the time, about
    what independent cores give. A pipeline's step waits for its slowest stage, so one slow core is
    a slow host."""
    global _fastest
    slowest = None
    for cpu in _cores():
        speed = _probe_on(cpu, chunks, loop)
        _fastest = max(_fastest, speed)
        slowest = speed if slowest is None else min(slowest, speed)
    assert slowest is not None
    return slowest


def _cores() -> list[int | None]:
    """The cores to probe one by one; [None] (wherever the thread runs) where affinity is unknown."""
    if not hasattr(os, "sched_getaffinity"):
        return [None]
    return [*sorted(os.sched_getaffinity(0))]


def _probe_on(cpu: int | None, chunks: int, loop: int) -> float:
    """One core's reading (see :func:`speed_probe`); `cpu` None: wherever the thread runs."""
    samples = sorted(_chunk_seconds(cpu, chunks, loop))
    return 1.0 / samples[len(samples) // 2]


_fastest_chunk = 0.0


def fast_share(chunks: int = 4, loop: int = 10_000) -> float:
    """The share of short probe chunks (about 0.4 ms each in the fast state), on every usable core in
    turn, that ran at no less than ``1 - SPEED_CLEAN`` of the fastest chunk this process has seen:
    how much of the time the host is in its fast state. One reading costs a few milliseconds; a
    measurement reads it once per round and reports the mean beside its figures (a host's cores
    that switch states every few milliseconds are fast a fifth of the time on this project's VM)."""
    global _fastest_chunk
    if _fastest_chunk == 0.0:             # a first reference: a few readings' fastest chunk
        _fastest_chunk = max(1.0 / s for _ in range(5) for cpu in _cores()
                             for s in _chunk_seconds(cpu, chunks, loop))
    speeds = [1.0 / s for cpu in _cores() for s in _chunk_seconds(cpu, chunks, loop)]
    _fastest_chunk = max(_fastest_chunk, *speeds)
    return sum(s >= (1.0 - SPEED_CLEAN) * _fastest_chunk for s in speeds) / len(speeds)


def _chunk_seconds(cpu: int | None, chunks: int, loop: int) -> list[float]:
    """Seconds of each of `chunks` runs of a `loop`-long pure-Python loop on core `cpu` (None:
    wherever the thread runs)."""
    saved = os.sched_getaffinity(0) if cpu is not None else None
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        samples = []
        for _ in range(chunks):
            t0 = time.perf_counter()
            acc = 0
            for i in range(loop):
                acc += i * i
            samples.append(time.perf_counter() - t0)
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)
    return samples


def fastest_speed() -> float:
    """The fastest :func:`speed_probe` reading of this process so far (0.0 before the first)."""
    return _fastest


OTHERS_CLEAN = 0.10
"""A measurement is *clean* only if, while it ran, processes other than its own used at most this
share of the host's CPU capacity (see :class:`HostWatch`): a host idle in the second before can get
busy a second later, and the load average counts the measurement's own processes."""


def _cpu_ticks_and_parents() -> dict[int, tuple[int, int]]:
    """pid -> (CPU ticks of the process and of its reaped children, parent pid), from /proc."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue                      # gone in between, or unreadable
        # after the command name: state, ppid, ..., utime (index 11), stime, cutime, cstime
        table[int(entry)] = (sum(int(x) for x in rest[11:15]), int(rest[1]))
    return table


def _descendants(root: int, *tables: Mapping[int, tuple[int, int]]) -> set[int]:
    """`root` and every process that was its descendant in any of the snapshots."""
    children: dict[int, list[int]] = {}
    for table in tables:
        for pid, (_, parent) in table.items():
            children.setdefault(parent, []).append(pid)
    tree, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return tree


class HostWatch:
    """The host's conditions before, during and after a measurement (a context manager).

    ::

        with HostWatch() as host:
            ...measure...
        record["host"] = host.conditions      # then is_clean(host.conditions)

    Before: :func:`conditions` (idle fraction over the last second, load average). During: the CPU
    time that processes *outside this process's tree* used while the body ran, as a share of the
    host's capacity (``others_cpu_fraction_during``), from /proc (each process's own and reaped
    children's ticks); the measurement's own stage processes, forkservers and torchrun workers are
    descendants and are not counted, however busy they are. After: the load average. Where /proc
    cannot be read the "during" share is None and only the state before decides.
    """

    def __init__(self, before: Callable[[], dict[str, Any]] | None = None) -> None:
        """`before`: the probe of the state before (default :func:`conditions`, which samples the
        CPU for a second)."""
        self._before = before or conditions
        self.conditions: dict[str, Any] = {}
        self._start: dict[int, tuple[int, int]] = {}
        self._t0 = 0.0

    def __enter__(self) -> HostWatch:
        self.conditions = dict(self._before())
        try:
            self._start = _cpu_ticks_and_parents()
        except OSError:
            self._start = {}
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self._t0
        others = None
        try:
            end = _cpu_ticks_and_parents()
        except OSError:
            end = {}
        seconds = None
        if self._start and end and wall > 0:
            seconds = others_cpu_ticks(self._start, end, os.getpid()) / os.sysconf("SC_CLK_TCK")
            others = seconds / (wall * usable_cores())
        self.conditions.update(others_cpu_fraction_during=others, others_cpu_seconds_during=seconds,
                               load_average_after=os.getloadavg()[0], seconds=wall)
        if self.conditions.get("speed_before") is not None:   # probed before: probe after too
            self.conditions.update(speed_after=speed_probe(), speed_fastest=fastest_speed())


def others_cpu_ticks(start: Mapping[int, tuple[int, int]], end: Mapping[int, tuple[int, int]],
                     root: int) -> int:
    """CPU ticks spent between two /proc snapshots (pid -> (ticks incl. reaped children, parent))
    by processes outside `root`'s tree. A process in the tree at either snapshot is the
    measurement's own; a process that appeared in between counts whole; one that ended in between
    counts through its parent's reaped-children ticks (or not at all if nothing reaped it)."""
    mine = _descendants(root, start, end)
    return max(0, sum(total - start.get(pid, (0, 0))[0] for pid, (total, _) in end.items()
                      if pid not in mine))


def is_clean(cond: Mapping[str, Any] | None) -> bool | None:
    """True/False for a measurement with recorded conditions; None where none were recorded (a
    result written before conditions were recorded: its cleanliness is unknown). Clean: the host
    was idle in the second before (>= IDLE_CLEAN) and, where it was watched (:class:`HostWatch`),
    other processes used at most OTHERS_CLEAN of its CPU while the measurement ran."""
    if not cond or cond.get("idle_fraction_before") is None:
        return None
    idle = cond["idle_fraction_before"]
    assert isinstance(idle, (int, float))
    others = cond.get("others_cpu_fraction_during")
    return (idle >= IDLE_CLEAN and (others is None or float(others) <= OTHERS_CLEAN)
            and not slowed_down(cond))


def slowed_down(cond: Mapping[str, Any]) -> float | None:
    """How much slower than its fastest the host ran the speed probe before or after a measurement,
    where that exceeds SPEED_CLEAN (e.g. 0.42: 42% slower); None where it did not or was not
    probed."""
    fastest = cond.get("speed_fastest")
    readings = [cond.get(k) for k in ("speed_before", "speed_after")]
    speeds = [float(r) for r in readings if r is not None]
    if not fastest or not speeds:
        return None
    slowest = 1.0 - min(speeds) / float(fastest)
    return slowest if slowest > SPEED_CLEAN else None


def busy_note(cond: Mapping[str, Any] | None) -> str:
    """"" for a clean measurement; otherwise the visible mark and why (for tables and captions)."""
    clean = is_clean(cond)
    if clean:
        return ""
    if clean is None:
        return f" {BUSY_MARK}(host state not recorded)"
    assert cond is not None
    return f" {BUSY_MARK}busy ({busy_readings(cond)})"


def busy_readings(cond: Mapping[str, Any]) -> str:
    """What a host's recorded conditions read: idle share before, load, other processes' CPU
    during and how much slower than its fastest the speed probe ran (those recorded)."""
    others = cond.get("others_cpu_fraction_during")
    during = "" if others is None else f", other processes {float(others):.0%} of the CPU during"
    slow = slowed_down(cond)
    slowed = "" if slow is None else f", host {slow:.0%} slower than its fastest"
    return (f"idle {float(cond['idle_fraction_before']):.0%}"
            f", load {float(cond.get('load_average_before') or 0.0):.1f}{during}{slowed}")
