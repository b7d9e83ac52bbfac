"""A run refused before it trains when its planned peak memory exceeds what the host has.

Why: sizes a user raises (a causal LM's ``--seq-len``, whose attention grows with its square; the
batch) can ask for more memory than the machine holds. The run then starts, and the kernel kills it,
or whatever else runs on the host, minutes later (``--seq-len 100000`` on a tiny LLaMA took 24 GB
of this project's 2-core host before it was killed). The memory planner
(:mod:`gpipe_repro.memory.planner`) simulates one training step's peak per device from fake tensors
(nothing is allocated) in about a second for a small model; a task offers its planner
(:meth:`~gpipe_repro.train.task.Task.memory_planner`), and the run compares the plan with the
memory there is before it builds the pipeline.

On the CPU every stage process (K x R of them) shares the host's memory: their peaks are summed
against the memory available now (``MemAvailable``). On CUDA each cell's peak is compared with its
device's total memory. A plan that cannot be made (a schedule or layer the planner does not take)
checks nothing: the guard only refuses what it has planned.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpipe_repro.train.pipeline import resolve_devices

__all__ = ["available_host_bytes", "check_planned_memory"]

GIB = 2 ** 30


def _size(nbytes: float) -> str:
    """GiB to one decimal; MiB below a tenth of a GiB."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2 ** 20:.0f} MiB"


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's memory available to a new process now (Linux's MemAvailable), None elsewhere."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_planned_memory(planner: Any, config: Any, advice: str) -> None:
    """Raise ValueError, before any work, where the run's planned peak does not fit (see the module
    docstring). `planner`: a :class:`~gpipe_repro.memory.planner.MemoryPlanner` of the run's model
    and one replica's share of the mini-batch (all of it without replicas); `config`: the run's
    :class:`~gpipe_repro.train.config.RunConfig`; `advice`: the options that lower the peak, as the
    task names them."""
    try:
        plan = planner.plan(config.partitions, config.micro_batches, config.checkpoint,
                            balance=config.balance, schedule=config.schedule,
                            transport="gloo" if config.runtime == "distributed" else "in-process")
    except Exception:       # noqa: BLE001 - a plan the planner cannot make checks nothing
        return
    peaks: Sequence[int] = plan.device_peaks
    devices = resolve_devices(config.device, len(peaks))    # None: the CPU
    if devices is not None:
        for k, (peak, device) in enumerate(zip(peaks, devices)):
            total = torch.cuda.get_device_properties(device).total_memory
            if peak > total:
                raise ValueError(
                    f"the run would need about {_size(peak)} on cell {k}'s GPU at its peak "
                    f"(planned) and the device has {_size(total)}: {advice}")
        return
    have = available_host_bytes()
    need = sum(peaks) * config.replicas
    if have is not None and need > have:
        shown = ", ".join(_size(p) for p in peaks)
        raise ValueError(
            f"the run would need about {_size(need)} of host memory at its peak (planned: "
            f"{shown} per cell{f', times {config.replicas} replicas' if config.replicas > 1 else ''}) "
            f"and this host has {_size(have)} available: {advice}")
