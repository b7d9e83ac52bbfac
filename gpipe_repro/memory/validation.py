"""Is the planner right? Its per-device peaks against the real engine's, measured.

Three numbers per device and configuration:

- ``planned``: the planner (layer profiles on fake tensors, composed along the schedule): simulated;
- ``traced``: the real engine (``GPipe.train_step``) run on fake tensors under the tracker:
  simulated, but by the engine's own code path;
- ``measured``: the same step run for real on this CPU under the tracker (live tensor storage).

On a CUDA device, :func:`validate_cuda` compares the planner with ``torch.cuda.max_memory_allocated``
(one device holding every cell, so K = 1); that path exists but has not been run in this project's
CPU-only sessions.

The small models used: an MLP, a small Transformer-L and a small AmoebaNet-D, so a real step takes
well under a second.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe_repro.memory.planner import MemoryPlanner
from gpipe_repro.memory.trace import trace_step


@dataclass
class Workload:
    """A model with a mini-batch and a loss: what a validation run needs."""

    name: str
    layers: list[nn.Module]
    sample: Any
    target: torch.Tensor
    loss_fn: Callable[[Any, Any], torch.Tensor]


def small_workloads(seed: int = 0) -> list[Workload]:
    """The three small models of the validation (built for real, on the CPU)."""
    from gpipe_repro.models.amoebanet import amoebanet, amoebanet_loss
    from gpipe_repro.models.transformer_lm import lm_loss, transformer_lm
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mlp: list[nn.Module] = [nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
                            for _ in range(5)]
    mlp.append(nn.Linear(64, 10))
    return [
        Workload("mlp", mlp, torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g),
                 nn.CrossEntropyLoss()),
        Workload("transformer", list(transformer_lm(4, d_model=64, d_ff=256, num_heads=4,
                                                    vocab_size=500)),
                 torch.randint(0, 500, (8, 32), generator=g), torch.randint(0, 500, (8, 32), generator=g),
                 lm_loss),
        Workload("amoebanet", list(amoebanet(3, 8, num_classes=10)),
                 torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g),
                 amoebanet_loss),
    ]


def compare(work: Workload, partitions: int, micro_batches: int, checkpoint: str,
            traced: bool = True) -> dict[str, Any]:
    """Planned, traced (optional) and measured per-device peaks (bytes) of one configuration."""
    measured = trace_step(work.layers, work.sample, work.target, work.loss_fn, partitions,
                          micro_batches, checkpoint, fake=False)
    planner = MemoryPlanner(work.layers, work.sample, work.target, work.loss_fn)
    plan = planner.plan(partitions, micro_batches, checkpoint, balance=measured.balance)
    # The engine does not allocate the caller's mini-batch: compare without the data parts.
    planned = [s.peak - s.parts.get("data", 0) for s in plan.stages]
    real = [s.peak for s in measured.stages]
    out: dict[str, Any] = {
        "model": work.name, "partitions": partitions, "micro_batches": micro_batches,
        "checkpoint": checkpoint, "balance": measured.balance, "measured_bytes": real,
        "planned_bytes": planned,
        "max_rel_error": max(abs(p - r) / r for p, r in zip(planned, real)),
        "methods": {"measured_bytes": "measured", "planned_bytes": "simulated",
                    "traced_bytes": "simulated"}}
    if traced:
        fake = trace_step(work.layers, work.sample, work.target, work.loss_fn, partitions,
                          micro_batches, checkpoint, balance=measured.balance, fake=True)
        out["traced_bytes"] = [s.peak for s in fake.stages]
    return out


def validate_cpu(workloads: Sequence[Workload], ks: Sequence[int] = (1, 2, 4),
                 checkpoints: Sequence[str] = ("except_last", "never"), micro_batches: int = 4,
                 traced: bool = True) -> list[dict[str, Any]]:
    """Every (workload, K, checkpoint). Real steps run on one thread: the models are tiny, and two
    threads on two busy cores only slow them down (memory does not depend on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [compare(w, k, micro_batches, c, traced)
                for w in workloads for k in ks for c in checkpoints]
    finally:
        torch.set_num_threads(threads)


def validate_cuda(work: Workload, micro_batches: int = 4, checkpoint: str = "except_last",
                  device: str = "cuda") -> dict[str, Any]:
    """K = 1 on one CUDA device: the planner's peak against ``torch.cuda.max_memory_allocated``.

    The model, batch and optimizer state are on the device before the measured step (a primed
    optimizer: steady state), so the allocator's peak over the step is what the planner predicts
    with the data included."""
    import copy

    from gpipe_repro.engine.arguments import declared_reduction
    from gpipe_repro.engine.gpipe import GPipe
    from gpipe_repro.memory.profile import rmsprop_foreach
    from gpipe_repro.memory.trace import prime_optimizer
    layers = [copy.deepcopy(layer).to(device) for layer in work.layers]
    sample = work.sample.to(device) if isinstance(work.sample, torch.Tensor) else work.sample
    target = work.target.to(device)
    pipe = GPipe(layers, partitions=1, micro_batches=micro_batches, checkpoint=checkpoint,
                 loss_fn=work.loss_fn, optimizer=rmsprop_foreach,   # declared: no first-step check
                 loss_reduction=declared_reduction(work.loss_fn) or "mean")
    prime_optimizer(pipe.optimizers[0])
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    pipe.train_step(sample, target)
    torch.cuda.synchronize(device)
    measured = torch.cuda.max_memory_allocated(device)
    planner = MemoryPlanner(work.layers, work.sample, work.target, work.loss_fn,
                            optimizer=rmsprop_foreach, optimizer_foreach=True)
    planned = planner.plan(1, micro_batches, checkpoint).max_peak
    return {"model": work.name, "device": torch.cuda.get_device_name(device),
            "micro_batches": micro_batches, "checkpoint": checkpoint,
            "measured_bytes": measured, "planned_bytes": planned,
            "rel_error": abs(planned - measured) / measured}


__all__ = ["Workload", "small_workloads", "compare", "validate_cpu", "validate_cuda"]
