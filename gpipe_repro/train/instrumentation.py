"""What the run loop measures besides the loss: pipeline busy/idle fractions and memory.

Why sampled. Recording a timeline costs a clock read per action and a Timeline object per step, and
its breakdown walks every event; doing that every step would be measurable overhead on a small
model. The loop turns `record_timeline` on for one step every `timeline_every` steps and logs what
that step looked like; the fractions are stable from step to step, so a sample is enough.

Memory "per device": on CUDA, `torch.cuda.max_memory_allocated` per device (the caching allocator's
peak, what a user compares with the card's memory). On the CPU every cell lives in one process, so
the honest number is the process's peak resident set size; beside it, per cell, the memory we can
account for exactly: parameters + gradients + optimizer state (the paper's 12 bytes per parameter
with RMSProp).
"""
from __future__ import annotations

import resource
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.timeline import Timeline


def timeline_metrics(timeline: Timeline) -> dict[str, float]:
    """`pipeline/stage{s}_busy` and `_idle` fractions of the step, and the paper's breakdown."""
    out: dict[str, float] = {}
    for s, busy in enumerate(timeline.utilization()):
        out[f"pipeline/stage{s}_busy"] = round(busy, 4)
        out[f"pipeline/stage{s}_idle"] = round(max(0.0, 1.0 - busy), 4)
    for category, fraction in timeline.breakdown().items():
        out[f"pipeline/{category.replace(' ', '_').replace('-', '')}"] = round(fraction, 4)
    out["pipeline/step_makespan_s"] = round(timeline.makespan, 4)
    return out


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def cell_state_mb(cell: nn.Module, optimizer: torch.optim.Optimizer | None) -> float:
    """Parameters + gradients + optimizer state of one cell, in MiB."""
    params = list(cell.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in (optimizer.state.values() if optimizer is not None else [])
             for v in s.values() if isinstance(v, torch.Tensor)]
    return (tensor_bytes(params) + tensor_bytes(grads) + tensor_bytes(state)) / 2**20


def memory_metrics(cells: Sequence[nn.Sequential], optimizers: Sequence[torch.optim.Optimizer | None],
                   devices: Sequence[torch.device]) -> dict[str, float]:
    """Peak memory per CUDA device, or the process's peak RSS on the CPU, plus per-cell state."""
    out: dict[str, float] = {}
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    for i in cuda:
        out[f"memory/cuda{i}_peak_mb"] = round(torch.cuda.max_memory_allocated(i) / 2**20, 2)
    if any(d.type == "cpu" for d in devices):
        out["memory/cpu_peak_rss_mb"] = round(peak_rss_mb(), 1)
    for k, (cell, optimizer) in enumerate(zip(cells, optimizers)):
        if len(cell):   # a distributed rank holds empty placeholders for the other ranks' cells
            out[f"memory/cell{k}_state_mb"] = round(cell_state_mb(cell, optimizer), 3)
    return out


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def flatten(prefix: str, values: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}/{k}": v for k, v in values.items()}
