"""Timing a layer's actions as the stage executor runs them, robustly."""
from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gpipe_repro.engine import boundary
from gpipe_repro.engine.batchnorm import DeferredBatchNorm, commit_all
from gpipe_repro.engine.recompute import recomputing
from gpipe_repro.engine.rng import seed_layer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def robust_seconds(samples: Sequence[float]) -> float:
    """The mean of repeated timings, trimmed of the fastest and slowest fifth.

    A mean because costs add up: a cell's expected time is the sum of its layers' expected times,
    jitter included (a low quantile of short timings misses the interruptions a long action cannot
    avoid). Trimmed so that a rare pause (a page fault, the garbage collector, a neighbour on the
    host) does not move a cost measured from a few dozen repeats.
    """
    ordered = sorted(samples)
    cut = len(ordered) // 5
    return statistics.fmean(ordered[cut:len(ordered) - cut] if len(ordered) > 2 * cut else ordered)


def time_layer_actions(layer: nn.Module, x: Any, device: torch.device | str, *, index: int = 0,
                       first: bool = False, loss: tuple[Callable[..., torch.Tensor], Any] | None = None,
                       repeats: int = 20, warmup: int = 2) -> tuple[float, float, float, float, float]:
    """Seconds of (forward, checkpointed forward, recompute, backward, optimizer step) of a copy of
    `layer` as the stage executor runs it (see the module docstring), by :func:`robust_seconds`.

    Unlike :func:`gpipe_repro.engine.layer_costs.measure_layer` (forward + backward only) it times
    every action the
    schedule has, leaves the first layer's input without a gradient (the runtime does not
    differentiate the data), and adds `loss` = (loss_fn, target) on the last layer.
    """
    device = torch.device(device)
    layer = DeferredBatchNorm.convert(copy.deepcopy(layer)).to(device).train()
    params = [p for p in layer.parameters() if p.requires_grad]
    opt = make_optimizer(params) if params else None

    def run(inp: Any) -> Any:
        seed_layer(0, 0, index, 0, device)
        y = layer(inp)
        return loss[0](y, loss[1]) if loss is not None else y

    def backward(y: Any) -> None:
        outs = [t for t in boundary.tensors(y) if t.is_floating_point() and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, None if loss is not None else
                                    [torch.ones_like(t) for t in outs])

    def stamp() -> float:
        _sync(device)
        return time.perf_counter()

    samples: list[tuple[float, ...]] = []
    for i in range(warmup + repeats):
        inp = boundary.to_device(x, device) if first else boundary.attach(x, device)
        t0 = stamp()
        with torch.no_grad():
            run(inp)                      # a checkpointed FORWARD
        t1 = stamp()
        y = run(inp)                      # a FORWARD that keeps its graph
        t2 = stamp()
        del y
        with recomputing():
            y = run(inp)                  # a RECOMPUTE
        t3 = stamp()
        backward(y)
        t4 = stamp()
        commit_all(layer)                 # the OPTIMIZER_STEP commits DeferredBatchNorm statistics
        if opt is not None:
            opt.step()
        t5 = stamp()
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        if i >= warmup:
            samples.append((t2 - t1, t1 - t0, t3 - t2, t4 - t3, t5 - t4))
    f, fng, r, b, o = (robust_seconds(col) for col in zip(*samples))
    return f, fng, r, b, o


def make_optimizer(params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer whose step the calibration times: plain SGD, the measured runs' default
    (:func:`gpipe_repro.distributed.measure.sgd`)."""
    return torch.optim.SGD(params, lr=0.01)


def optimizer_call_overhead(device: torch.device | str = "cpu", repeats: int = 50) -> float:
    """Seconds of one optimizer step on a single scalar parameter: the fixed cost of a call, which a
    cell pays once however many layers it holds."""
    p = nn.Parameter(torch.zeros(1, device=device))
    opt = make_optimizer([p])
    samples = []
    for _ in range(repeats + 5):
        p.grad = torch.ones_like(p)
        t0 = time.perf_counter()
        opt.step()
        _sync(torch.device(device))
        samples.append(time.perf_counter() - t0)
    return robust_seconds(samples[5:])


def forward_flops(layer: nn.Module, x: Any) -> int:
    """Forward FLOPs of `layer` on `x` (meta tensors are fine)."""
    layer = copy.deepcopy(layer)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        layer(x)
    return counter.get_total_flops()


