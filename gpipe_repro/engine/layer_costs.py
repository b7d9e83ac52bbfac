"""Per-layer cost estimates, the input of the partitioner and of the simulator.

Five sources, because each answers a different question:

- ``time``: measured forward + backward seconds on a given device: the median over interleaved
  rounds, each timing every layer once (:func:`measure_layers`). The truth for throughput, but noisy
  and device-specific. Each layer is deep-copied so measuring never changes the
  model (BatchNorm statistics, gradients).
- ``flops``: forward + backward FLOPs from ``torch.utils.flop_counter``: deterministic, device-free.
- ``params``: parameter bytes: what a cell costs in memory, and a usable proxy when no sample exists.
- ``activations``: bytes of each layer's output for the sample batch: what a boundary costs to stash
  or to send.
- a list the caller gives.

Left out (``None``), the cost is ``time`` when a sample is given (torchgpipe's ``balance_by_time``:
a parameter count says little of a layer's compute, so the cut it gives can leave one cell ten
times slower than the other) and ``params`` without one.

With a loss (``loss=(loss_fn, target)``, ``GPipe(..., sample_target=y)``) the last layer's ``time``
and ``flops`` include the loss's forward and backward, as the last cell runs them: on a language
model the cross-entropy over the vocabulary costs a large share of the head, and a cut that leaves it
out gives the last cell too many layers (Megatron-Core's ``account_for_loss_in_pipeline_split`` for
the same reason).

Layers are fed the sample in sequence, so each is measured on its real input. Each measurement feeds
its layer a fresh copy of that input, so in-place layers (``ReLU(inplace=True)``) neither corrupt
the next layer's input nor the caller's `sample`, and never modify an autograd leaf.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gpipe_repro.engine import boundary
from gpipe_repro.engine.backward_split import DeferredWeights, WeightWork
from gpipe_repro.engine.microbatch import batch_size
from gpipe_repro.engine.partition import finite_non_negative, partition

__all__ = ["METHODS", "layer_inputs", "measure_layer", "measure_layers", "likeness", "layer_flops",
           "counting_flops", "layer_flop_counts", "param_bytes", "activation_bytes", "layer_costs",
           "split_layer_costs", "cut_layers"]

METHODS = ("time", "flops", "params", "activations")


def _copy(value: Any) -> Any:
    """A copy of every tensor of `value` that a layer may modify in place (gradients flow through)."""
    return boundary.map_tensors(value, lambda t: t.clone())


def layer_inputs(layers: Sequence[nn.Module], sample: Any) -> list[Any]:
    """The input each layer receives when `sample` flows through the model. Each layer runs as a deep
    copy under no_grad, so the model itself is untouched (no BatchNorm statistics change)."""
    inputs, x = [], sample
    with torch.no_grad():
        for layer in layers:
            inputs.append(x)
            x = copy.deepcopy(layer)(_copy(x))
    return inputs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Loss = tuple[Callable[[Any, Any], Any], Any]   # (loss_fn, target): loss_fn(output, target)


def _floating_sum(value: Any) -> torch.Tensor | None:
    ts = [t for t in boundary.tensors(value) if boundary.carries_grad(t) and t.requires_grad]
    return sum(t.float().sum() for t in ts) if ts else None  # type: ignore[return-value]


def _with_loss(out: Any, loss: Loss | None) -> Any:
    """`out`, or the loss of it: a 0-dim tensor, or the sum of a ``(sum, count)`` loss."""
    if loss is None:
        return out
    value = loss[0](out, loss[1])
    return value[0] if isinstance(value, tuple) else value


def _backward(out: Any, layer: nn.Module, leaves: Any, loss: Loss | None) -> None:
    """The backward of a measured forward into `layer`'s (a copy's) parameters and the input
    `leaves` only: a loss may hold tensors of the caller's that require a gradient (a closure's: a
    loss module may hold no trainable parameter, GPipe refuses one), and measuring must not leave
    one in them, so their gradients are not timed."""
    s = _floating_sum(out)
    if s is None:
        return
    if loss is None:
        s.backward()
        return
    inputs = [p for p in layer.parameters() if p.requires_grad] + [
        t for t in boundary.tensors(leaves) if t.requires_grad]
    if inputs:
        torch.autograd.backward(s, inputs=inputs)


def _split_backward(out: Any, layer: nn.Module, leaves: Any, work: WeightWork | None) -> None:
    """The backward of a measured forward as a zero-bubble stage runs it: its input half (autograd's,
    the forward having deferred what :mod:`gpipe_repro.engine.backward_split` defers), then its weight
    half (`work`), into `layer`'s parameters and the input `leaves` only (as :func:`_backward`)."""
    s = _floating_sum(out)
    if s is None:
        return
    inputs = [p for p in layer.parameters() if p.requires_grad] + [
        t for t in boundary.tensors(leaves) if t.requires_grad]
    if inputs:
        torch.autograd.backward(s, inputs=inputs)
    if work is not None:
        work()


def measure_layer(layer: nn.Module, x: Any, device: torch.device | str = "cpu", repeats: int = 5,
                  warmup: int = 2, loss: Loss | None = None, split: bool = False) -> tuple[float, float]:
    """Median (forward, backward) seconds of a copy of `layer` on input `x` on `device`; with
    `loss`, the layer and its loss (the target already on `device`); `split`: the backward split
    into its input and weight halves, as a zero-bubble schedule's stage runs it."""
    device = torch.device(device)
    layer = copy.deepcopy(layer).to(device).train()
    deferral = DeferredWeights(layer) if split else None
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        leaves = boundary.attach(x, device)
        inp = _copy(leaves)
        _sync(device)
        t0 = time.perf_counter()
        with deferral.recording() if deferral is not None else contextlib.nullcontext() as work:
            out = layer(inp)
        out = _with_loss(out, loss)
        _sync(device)
        t1 = time.perf_counter()
        if split:
            _split_backward(out, layer, leaves, work)
        else:
            _backward(out, layer, leaves, loss)
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        layer.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd)


def measure_layers(layers: Sequence[nn.Module], inputs: Sequence[Any], device: torch.device | str = "cpu",
                   rounds: int = 5, loss: Loss | None = None, split: bool = False) -> list[tuple[float, ...]]:
    """Median (forward, backward) seconds of each layer over `rounds` interleaved rounds: a round
    times every layer once (a fresh copy, one untimed call first), forward order and reverse in
    turn. A host whose speed drifts or flips between states (a shared VM, a GPU changing clocks)
    then spreads its slow spells over every layer alike, where timing each layer's repeats back to
    back hands a whole slow spell to whichever layer was on. Layers alike (:func:`likeness`: the
    same module, parameters and input shapes, as a Transformer's blocks) share the median of all
    their readings: one cost, not costs apart by the host's noise, which moved the cut between runs.
    `loss`: timed with the last layer (which then is like no other). `split`: each round also times
    the backward split into its input and weight halves (:func:`measure_layer`), right after the
    whole one, and each layer's figures are (forward, backward, split backward); the split's figure
    includes what its forward costs over a plain one (the deferred layers' bookkeeping), as the
    calibration counts it (:mod:`gpipe_repro.sim.calibration.timing`)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    samples: list[list[tuple[float, ...]]] = [[] for _ in layers]
    order = list(range(len(layers)))
    last = len(layers) - 1
    for r in range(rounds):
        for i in (order if r % 2 == 0 else order[::-1]):
            at = loss if i == last else None
            whole = measure_layer(layers[i], inputs[i], device, repeats=1, warmup=1, loss=at)
            if split:   # the split forward's extra over the plain one counts with the split backward
                forward, backward = measure_layer(layers[i], inputs[i], device, repeats=1, warmup=1,
                                                  loss=at, split=True)
                samples[i].append(whole + (backward + forward - whole[0],))
            else:
                samples[i].append(whole)
    pooled: dict[Any, list[tuple[float, ...]]] = {}
    keys = [likeness(layer, x) + (("loss",) if loss is not None and i == last else ())
            for i, (layer, x) in enumerate(zip(layers, inputs))]
    for key, s in zip(keys, samples):
        pooled.setdefault(key, []).extend(s)
    return [tuple(statistics.median(col) for col in zip(*pooled[k])) for k in keys]


def likeness(layer: nn.Module, x: Any) -> tuple[Any, ...]:
    """What makes two layers cost alike: the module's type and printed form (its submodules and
    their sizes), its parameters' and buffers' shapes and dtypes, and its input's."""
    def shapes(tensors: Any) -> tuple[Any, ...]:
        return tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)
    return (type(layer).__qualname__, repr(layer), shapes(p for _, p in layer.named_parameters()),
            shapes(b for _, b in layer.named_buffers()), shapes(boundary.tensors(x)))


@contextlib.contextmanager
def counting_flops() -> Any:
    """torch's FLOP counter, with attention by its math backend: on CPU tensors the fused kernel
    ``scaled_dot_product_attention`` picks is not counted at all (0 FLOPs for a Transformer's
    attention, which then weighed nothing in a cut by ``cost="flops"``); the math backend does the
    same products, each counted."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
        yield counter


def layer_flops(layer: nn.Module, x: Any, loss: Loss | None = None) -> int:
    """Forward + backward FLOPs of `layer` on `x` (torch.utils.flop_counter); with `loss`, its too."""
    layer = copy.deepcopy(layer)
    tensors = boundary.tensors(x)
    leaves = boundary.attach(x, tensors[0].device if tensors else torch.device("cpu"))
    inp = _copy(leaves)
    with counting_flops() as counter:
        _backward(_with_loss(layer(inp), loss), layer, leaves, loss)
    return counter.get_total_flops()


def layer_flop_counts(layer: nn.Module, x: Any) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of `layer` on `x` in one pass: the counter is read after
    the forward and again after the backward (meta tensors are fine). The same counts as
    :func:`gpipe_repro.sim.calibration.timing.forward_flops` and :func:`layer_flops` (tests/sim/
    test_calibration.py checks it layer by layer on every model family) for one forward fewer."""
    layer = copy.deepcopy(layer)
    inp = _copy(boundary.attach(x, torch.device("cpu") if not boundary.tensors(x)
                                else boundary.tensors(x)[0].device))
    with counting_flops() as counter:
        out = layer(inp)
        forward = counter.get_total_flops()
        s = _floating_sum(out)
        if s is not None:
            s.backward()
    return forward, counter.get_total_flops()


def param_bytes(layer: nn.Module) -> int:
    """Bytes of `layer`'s parameters."""
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def activation_bytes(value: Any) -> int:
    """Bytes of the tensors of a boundary value."""
    return sum(t.numel() * t.element_size() for t in boundary.tensors(value))


def layer_costs(layers: Sequence[nn.Module], method: str | Sequence[float] | None = "params",
                sample: Any = None, device: torch.device | str = "cpu", repeats: int = 5,
                loss: Loss | None = None) -> list[float]:
    """One cost per layer by `method` (see the module docstring), or the caller's list checked;
    `method` None: "time" with a `sample`, else "params". `loss`: (loss_fn, the targets of
    `sample`), measured with the last layer by "time" and "flops"."""
    method = default_method(method, sample)
    if not isinstance(method, str):
        costs = finite_non_negative("cost", method)
        if len(costs) != len(layers):
            raise ValueError(f"{len(costs)} costs given for {len(layers)} layers: give one per layer")
        return costs
    if method not in METHODS:
        raise ValueError(f"cost must be one of {METHODS} or a list of floats, got {method!r}")
    if method == "params":
        return [float(param_bytes(layer)) for layer in layers]
    if sample is None:
        raise ValueError(f"cost={method!r} needs a sample input batch (sample=...); or use cost='params'")
    if batch_size(sample, "sample") == 0:
        raise ValueError(f"sample has no rows: cost={method!r} measures the layers on it; give a batch "
                         "of at least one row (a micro-batch's rows measure what a step runs)")
    inputs = layer_inputs(layers, sample)
    if method == "activations":
        with torch.no_grad():
            return [float(activation_bytes(copy.deepcopy(layer)(_copy(x))))
                    for layer, x in zip(layers, inputs)]
    last = len(layers) - 1
    if method == "flops":
        tensors = boundary.tensors(inputs[last])
        at = _loss_on(loss, tensors[0].device if tensors else torch.device("cpu"))
        return [float(layer_flops(layer, x, at if i == last else None))
                for i, (layer, x) in enumerate(zip(layers, inputs))]
    return [f + b for f, b in measure_layers(layers, inputs, device, rounds=repeats,
                                             loss=_loss_on(loss, torch.device(device)))]


def default_method(method: str | Sequence[float] | None, sample: Any) -> str | Sequence[float]:
    """`method`, or where it is None the default: "time" with a `sample`, else "params"."""
    if method is None:
        return "time" if sample is not None else "params"
    return method


def measure_split_costs(layers: Sequence[nn.Module], sample: Any, device: torch.device | str = "cpu",
                        repeats: int = 5, loss: Loss | None = None) -> list[tuple[float, float, float]]:
    """Each layer's (forward, whole backward, split backward) seconds on `sample`, from the same
    interleaved rounds (:func:`measure_layers` with `split`)."""
    if sample is None:
        raise ValueError("measuring the split backward needs a sample input batch (sample=...)")
    timed = measure_layers(layers, layer_inputs(layers, sample), device, rounds=repeats,
                           loss=_loss_on(loss, torch.device(device)), split=True)
    return [(f, b, s) for f, b, s in timed]


def split_layer_costs(layers: Sequence[nn.Module], sample: Any, device: torch.device | str = "cpu",
                      repeats: int = 5, loss: Loss | None = None) -> tuple[list[float], list[float]]:
    """Measured seconds per layer of a zero-bubble schedule's cells (:func:`measure_split_costs`):
    (forward + both halves of the split backward, as the cells after the first run them; forward +
    whole backward, as the first runs them: its input takes no gradient). The partitioner's `costs`
    and `first` (:func:`gpipe_repro.engine.partition.partition`)."""
    timed = measure_split_costs(layers, sample, device, repeats, loss)
    return split_and_whole(timed)


def split_and_whole(timed: Sequence[tuple[float, float, float]]) -> tuple[list[float], list[float]]:
    """Per layer (forward + split backward, forward + whole backward) of
    :func:`measure_split_costs`'s figures."""
    return [f + s for f, _, s in timed], [f + b for f, b, _ in timed]


def _loss_on(loss: Loss | None, device: torch.device) -> Loss | None:
    """`loss` with its target on `device`, and a loss module (its buffers: a class weight) copied
    there, as the last stage holds them."""
    if loss is None:
        return None
    fn = copy.deepcopy(loss[0]).to(device) if isinstance(loss[0], nn.Module) else loss[0]
    return fn, boundary.to_device(loss[1], device)


def cut_layers(layers: Sequence[nn.Module], partitions: int, objective: str,
               cost: str | Sequence[float] | None, sample: Any, loss: Loss | None,
               splits_backward: bool, device: torch.device | str = "cpu") -> list[int]:
    """GPipe's automatic cut: :func:`partition` of :func:`layer_costs` (timed on `device`); for a
    schedule that splits most backwards (:attr:`Schedule.cut_by_split_costs`: zb-h1 and zb-v as
    written) with costs by time and the bottleneck objective, of what each cell runs
    (:func:`split_layer_costs`: the first cell whole backwards, the others both halves), as the
    harness cuts them (:func:`gpipe_repro.sim.partition_choice.choose_cut`)."""
    if splits_backward and default_method(cost, sample) == "time" and sample is not None \
            and objective == "bottleneck":
        split, whole = split_layer_costs(layers, sample, device, loss=loss)
        return partition(split, partitions, objective, first=whole)
    return partition(layer_costs(layers, cost, sample, device, loss=loss), partitions, objective)
