"""Timing a layer's actions as the stage executor runs them, robustly."""
from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine import boundary
from gpipe_repro.engine.backward_split import DeferredWeights, WeightWork, takes_gradient
from gpipe_repro.engine.batchnorm import DeferredBatchNorm, commit_all
from gpipe_repro.engine.feeding import guard_input
from gpipe_repro.engine.layer_costs import counting_flops
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


class _TimedLayer:
    """A real copy of one layer as a stage holds it (DeferredBatchNorm, its own optimizer) and the
    actions the stage executor runs on it."""

    def __init__(self, layer: nn.Module, device: torch.device, index: int,
                 loss: tuple[Callable[..., torch.Tensor], Any] | None) -> None:
        self.layer = DeferredBatchNorm.convert(copy.deepcopy(layer)).to(device).train()
        params = [p for p in self.layer.parameters() if p.requires_grad]
        self.opt = make_optimizer(params) if params else None
        self.device, self.index, self.loss = device, index, loss
        self.copies: bool | None = None    # whether it modifies its input in place (learned)
        self.deferral = DeferredWeights(self.layer)

    def run(self, inp: Any) -> Any:
        """The layer on `inp` as the stage executor feeds it (:func:`gpipe_repro.engine.feeding.feed`):
        a copy where the layer modifies its input in place (``ReLU(inplace=True)`` right after a
        cut: learned on the first run, as the executor learns it), else a view; the copy's time is
        part of the layer's."""
        seed_layer(0, 0, self.index, 0, self.device)
        fed = guard_input(inp, self.copies)
        y = self.layer(fed.value)
        if self.copies is None:
            self.copies = fed.modified()
        return self.loss[0](y, self.loss[1]) if self.loss is not None else y

    def backward(self, y: Any) -> None:
        outs = [t for t in boundary.tensors(y) if boundary.carries_grad(t) and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, None if self.loss is not None else
                                    [torch.ones_like(t) for t in outs])

    def run_split(self, inp: Any) -> tuple[Any, WeightWork | None]:
        """The layer on `inp` as a zero-bubble stage runs a forward whose backward it splits
        (:mod:`gpipe_repro.engine.backward_split`), and the weight work it deferred; None where
        there is no input gradient to split off (the model's first layer: a stage 0 runs its whole
        backward at W)."""
        if not takes_gradient(inp):
            return self.run(inp), None
        with self.deferral.recording() as work:
            y = self.run(inp)
        return y, work

    def backward_input(self, y: Any, work: WeightWork | None) -> Callable[[], None] | None:
        """The zero-bubble split's BACKWARD_INPUT of a :meth:`run_split` as the stage executor runs
        it (autograd's backward, without the deferred weight gradients); returns its
        BACKWARD_WEIGHT (`work`), None where nothing was split."""
        outs = [t for t in boundary.tensors(y) if boundary.carries_grad(t) and t.requires_grad]
        if not outs or work is None:
            return None
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        return work

    def step(self) -> None:
        commit_all(self.layer)            # the OPTIMIZER_STEP commits DeferredBatchNorm statistics
        if self.opt is not None:
            self.opt.step()

    def zero_grad(self) -> None:
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)


#: What the timing functions return per layer: seconds of FORWARD, checkpointed FORWARD, RECOMPUTE,
#: BACKWARD (into fresh gradients), OPTIMIZER_STEP, the extra of a BACKWARD into existing gradients,
#: and the zero-bubble split's BACKWARD_INPUT and BACKWARD_WEIGHT (into existing gradients; None for
#: a layer whose input takes no gradient). A split micro-batch's forward costs a little more than a
#: plain one (it detaches the deferred layers' weights and keeps their inputs:
#: :mod:`gpipe_repro.engine.backward_split`); that extra is counted in its BACKWARD_INPUT, so a stage's
#: total is right and FORWARD stays one figure for every schedule.
ActionSeconds = tuple[float, float, float, float, float, float, float | None, float | None]


def _summary(samples: Sequence[tuple[float, ...]], has_params: bool, splits: bool) -> ActionSeconds:
    """:data:`ActionSeconds` from samples of (forward, checkpointed forward, recompute, backward into
    fresh gradients, optimizer, backward into existing ones, split input, split weight)."""
    f, fng, r, b, o, b_acc, b_in, b_w = (robust_seconds(col) for col in zip(*samples))
    # the split input backward is a difference of timings (its own, plus the split forward's extra
    # over a recompute), which a busy host's few samples can take below zero
    return (f, fng, r, b, o, (max(0.0, b_acc - b) if has_params else 0.0),
            max(0.0, b_in) if splits else None, b_w if splits else None)


def time_layer_actions(layer: nn.Module, x: Any, device: torch.device | str, *, index: int = 0,
                       first: bool = False, loss: tuple[Callable[..., torch.Tensor], Any] | None = None,
                       repeats: int = 20, warmup: int = 2) -> ActionSeconds:
    """Seconds of (forward, checkpointed forward, recompute, backward, optimizer step, gradient
    accumulation, split input backward, split weight backward: :data:`ActionSeconds`) of a copy of
    `layer` as the stage executor runs it (see the module docstring), by :func:`robust_seconds`, the
    layer alone: every action right after the previous one on the same
    layer, so its weights stay in the caches (see :func:`time_model_actions` for the difference).

    The backward is timed twice: into parameters without gradients (a stage's first backward of a
    step writes fresh ``p.grad``: ``StageExecutor.begin_step`` sets them to None) and into existing
    ones (every later micro-batch adds into ``p.grad``: a read and a write of every gradient, which
    at small micro-batches costs as much as the matmuls: 40-50% of a residual MLP block's backward at
    32 rows on this project's host). The sixth value is the difference, the extra seconds of an
    accumulating backward (0 for a layer without trainable parameters).

    Unlike :func:`gpipe_repro.engine.layer_costs.measure_layer` (forward + backward only) it times
    every action the schedule has, leaves the first layer's input without a gradient (the runtime
    does not differentiate the data), and adds `loss` = (loss_fn, target) on the last layer.
    """
    device = torch.device(device)
    t = _TimedLayer(layer, device, index, loss)

    def stamp() -> float:
        _sync(device)
        return time.perf_counter()

    samples: list[tuple[float, ...]] = []
    for i in range(warmup + repeats):
        inp = boundary.to_device(x, device) if first else boundary.attach(x, device)
        t0 = stamp()
        with torch.no_grad():
            t.run(inp)                    # a checkpointed FORWARD
        t1 = stamp()
        y = t.run(inp)                    # a FORWARD that keeps its graph
        t2 = stamp()
        del y
        with recomputing():
            y = t.run(inp)                # a RECOMPUTE
        t3 = stamp()
        t.backward(y)                     # a BACKWARD into fresh gradients
        t4 = stamp()
        t.step()
        t5 = stamp()
        t6 = t7 = t5
        if t.opt is not None:
            with recomputing():
                y = t.run(inp)
            t6 = stamp()
            t.backward(y)                 # a BACKWARD adding into existing gradients
            t7 = stamp()
        with recomputing():
            y, work = t.run_split(inp)
        t8 = stamp()
        weight = t.backward_input(y, work)        # the zero-bubble split: BACKWARD_INPUT
        t9 = stamp()
        if weight is not None:
            weight()                              # BACKWARD_WEIGHT, into existing gradients
        t10 = stamp()
        splits = weight is not None
        t.zero_grad()
        if i >= warmup:   # the split forward's extra over a plain one is counted with its I
            samples.append((t2 - t1, t1 - t0, t3 - t2, t4 - t3, t5 - t4, t7 - t6,
                            t9 - t8 + (t8 - t7) - (t3 - t2), t10 - t9))
    return _summary(samples, t.opt is not None, splits)


def time_model_actions(layers: Sequence[nn.Module], x: Any, device: torch.device | str, *,
                       loss: tuple[Callable[..., torch.Tensor], Any] | None = None,
                       repeats: int = 20, warmup: int = 2) -> list[ActionSeconds]:
    """:func:`time_layer_actions` of every layer of a whole model at once, in the order a stage
    runs them: each action through all the layers (forwards first to last, backwards last to
    first) before the next action, so between two uses of a layer's weights the other layers' weights,
    gradients and activations pass through the caches, as in a pipeline stage. `x` is the first
    layer's input; each layer gets the previous one's real output; `loss` goes on the last layer.

    Why: a layer timed alone keeps its weights and gradients in the caches, a stage cycling through
    its layers streams them from memory. On this project's 2-core host (residual MLP blocks of
    width 1024, 16 MB of weights each): forward + backward per block 9.3 ms alone, 12.5 ms inside
    a pipeline stage at 32-row micro-batches (+34%); nothing at 256 rows. This is how torchgpipe's
    ``balance_by_time`` and PipeDream's profiler time layers: the whole model on one device.
    """
    device = torch.device(device)
    last = len(layers) - 1
    timed = [_TimedLayer(layer, device, i, loss if i == last else None) for i, layer in enumerate(layers)]
    first_input = boundary.to_device(x, device)

    def stamp() -> float:
        _sync(device)
        return time.perf_counter()

    samples: list[list[tuple[float, ...]]] = [[] for _ in timed]
    splits = [True] * len(timed)
    forward_order, backward_order = list(range(len(timed))), list(range(last, -1, -1))
    # Slots: 0 FORWARD, 1 checkpointed FORWARD, 2 RECOMPUTE, 3 BACKWARD into fresh gradients,
    # 4 OPTIMIZER_STEP, 5 BACKWARD adding into existing gradients, 6 and 7 the zero-bubble split's
    # BACKWARD_INPUT and BACKWARD_WEIGHT (every input pass last to first, then every weight pass).
    for rep in range(warmup + repeats):
        seconds = [[0.0] * 8 for _ in timed]
        outs: list[Any] = []
        with torch.no_grad():
            for i in forward_order:
                t0 = stamp()
                outs.append(timed[i].run(first_input if i == 0 else outs[-1]))
                seconds[i][1] = stamp() - t0
        ins = [first_input] + [boundary.attach(y, device) for y in outs[:-1]]
        for slot in (0, 2, 5):
            ys: list[Any] = []
            with recomputing() if slot else contextlib.nullcontext():
                for i in forward_order:
                    t0 = stamp()
                    ys.append(timed[i].run(ins[i]))
                    if slot != 5:             # the forward before the accumulating backward
                        seconds[i][slot] = stamp() - t0
            if slot == 0:
                continue                      # a FORWARD's graph is dropped (recomputed below)
            for i in backward_order:
                t0 = stamp()
                timed[i].backward(ys[i])
                seconds[i][3 if slot == 2 else 5] = stamp() - t0
            if slot == 2:
                for i in forward_order:
                    t0 = stamp()
                    timed[i].step()
                    seconds[i][4] = stamp() - t0
        split_runs, split_forward = [], []
        with recomputing():
            for i in forward_order:
                t0 = stamp()
                split_runs.append(timed[i].run_split(ins[i]))
                split_forward.append(stamp() - t0)
        weights: dict[int, Callable[[], None] | None] = {}
        for i in backward_order:
            t0 = stamp()
            weights[i] = timed[i].backward_input(*split_runs[i])
            # the split forward's extra over a plain one is counted with its I
            seconds[i][6] = stamp() - t0 + split_forward[i] - seconds[i][2]
            splits[i] = weights[i] is not None
        for i in backward_order:
            work = weights[i]
            if work is not None:
                t0 = stamp()
                work()
                seconds[i][7] = stamp() - t0
        del split_runs, weights
        for t in timed:
            t.zero_grad()
        if rep >= warmup:
            for i, row in enumerate(seconds):
                samples[i].append(tuple(row))
    return [_summary(col, t.opt is not None, split) for col, t, split in zip(samples, timed, splits)]


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
    with counting_flops() as counter, torch.no_grad():
        layer(x)
    return counter.get_total_flops()


