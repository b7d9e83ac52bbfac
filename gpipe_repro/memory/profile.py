"""A layer's memory profile: what one layer costs in each pass the engine runs, measured once.

The engine runs a layer in three ways (see :mod:`gpipe_repro.engine.stage`): a forward that keeps its
autograd graph (a FORWARD without re-materialization, or a RECOMPUTE), a forward under ``no_grad``
(a re-materialized FORWARD), and a backward. :func:`profile_layer` runs each of them once on a fake
copy of the layer (``FakeTensorMode``: real kernels' shape functions, no memory) under a
:class:`~gpipe_repro.memory.tracker.MemoryTracker` that logs every allocation and free, and reduces
the log to what :mod:`gpipe_repro.memory.compose` needs to replay the layer anywhere in a schedule:

- peaks above the level at the start of each pass (temporaries included);
- what the graph keeps: bytes of its own tensors (``saved_internal``), and *which* of the layer's
  inputs and outputs it keeps (so a layer's output lives on exactly as long as some graph needs it:
  found with ``torch.autograd.graph.saved_tensors_hooks``);
- which outputs pass an input through (AmoebaNet's cells return ``(cur, new)``), and which input
  gradients alias an output gradient;
- gradient, optimizer-state and optimizer-step bytes of the parameters, and forward/backward FLOPs.

The backward is driven by a tiny autograd function that creates the output gradients *inside* the
backward, as the next layer's backward would, so the profile sees them freed when consumed. Peaks
are reported two ways: for a layer inside a cell, and for a cell's last layer, whose output and
incoming gradient the executor holds until the whole cell's backward ends.

Attention: under fake CPU tensors ``scaled_dot_product_attention`` dispatches to the fused kernel
PyTorch runs for real (``_scaled_dot_product_flash_attention_for_cpu``: output + logsumexp forward,
dq/dk/dv backward; CUDA fp32 takes the memory-efficient kernel, which saves the same), so attention
costs what the fused kernel allocates at its interface, not an N x heads x T x T matrix. Pass
``attention="math"`` to measure PyTorch's unfused math backend instead (it materializes the
attention matrix, as XLA did on the paper's TPUs). Kernel-internal workspaces are not visible.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from gpipe_repro.engine.backward_split import DeferredWeights, deferrable
from gpipe_repro.engine.batchnorm import DeferredBatchNorm, commit_many, is_one_value_per_channel
from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.layer_costs import counting_flops
from gpipe_repro.memory.fake import fake_module
from gpipe_repro.memory.tracker import MemoryTracker, storage_of
from gpipe_repro.models.signature import TensorSig, ValueSig, layer_key, make_value, value_sig

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
ATTENTION = ("fused", "math")


def rmsprop(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The paper's optimizer: RMSProp with one state slot (12 bytes per parameter in all)."""
    return torch.optim.RMSprop(params, lr=1e-3)


def rmsprop_foreach(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """RMSProp updating all of a cell's parameters in one multi-tensor pass (CUDA's default), whose
    temporaries (4 bytes per parameter) span the whole cell during the step."""
    return torch.optim.RMSprop(params, lr=1e-3, foreach=True)


def sgd_foreach(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Plain SGD (no state), in one multi-tensor pass."""
    return torch.optim.SGD(params, lr=1e-3, foreach=True)


def momentum_foreach(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum (one state slot), in one multi-tensor pass."""
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)


def adam_foreach(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Adam (two state slots and a step count per parameter), in one multi-tensor pass."""
    return torch.optim.Adam(params, lr=1e-3, foreach=True)


def adamw_foreach(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW (Adam's state), in one multi-tensor pass."""
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


#: The optimizers a plan can hold the state of, by the name `fit`, `plan` and `plan-replicas` take
#: (``--optimizer``): (factory, title, what it keeps per fp32 parameter beside weight and gradient).
OPTIMIZERS: dict[str, tuple[OptimizerFactory, str, str]] = {
    "sgd": (sgd_foreach, "SGD", "no state: 8 bytes a parameter in fp32"),
    "momentum": (momentum_foreach, "SGD with momentum", "1 state: 12 bytes a parameter in fp32"),
    "rmsprop": (rmsprop_foreach, "RMSProp", "1 state: 12 bytes a parameter in fp32"),
    "adam": (adam_foreach, "Adam", "2 states: 16 bytes a parameter in fp32"),
    "adamw": (adamw_foreach, "AdamW", "2 states: 16 bytes a parameter in fp32"),
}


@dataclass(frozen=True)
class LayerProfile:
    """One layer on one input signature (bytes; see the module docstring)."""

    name: str
    in_sig: ValueSig
    out_sig: ValueSig                   # the output as the next layer of the same cell receives it
    out_origin: tuple[int | None, ...]  # per output storage group: the input group it passes through
    # forward that keeps its graph (FORWARD without re-materialization, RECOMPUTE)
    fwd_peak: int
    saved_internal: int                 # bytes the graph keeps that are neither input nor output
    saved_in: frozenset[int]            # input groups the graph keeps
    saved_out: frozenset[int]           # new output groups the graph keeps
    state_bytes: int                    # left in the module by a training forward (BatchNorm stats)
    # forward under no_grad (a re-materialized FORWARD)
    nograd_peak: int
    # backward: peak above its start, indexed [accumulate][held] (params already have .grad; the
    # output and its gradient are held by the executor: the last layer of a cell)
    bwd_peak: tuple[tuple[int, int], tuple[int, int]]
    in_grads: tuple[tuple[str, int] | None, ...]  # per input group: ("new", bytes) | ("out", group)
    param_bytes: int
    buffer_bytes: int
    grad_bytes: int                     # .grad bytes a first backward leaves
    opt_state_bytes: int
    opt_peak: int                       # transient of one optimizer step on this layer alone
    fwd_flops: int
    bwd_flops: int
    has_flops: bool = False
    # what a zero-bubble split keeps from BACKWARD_INPUT to BACKWARD_WEIGHT: the inputs of the
    # layers whose weight gradients it defers and their outputs' gradients (engine.backward_split)
    deferred_bytes: int = 0
    deferred_grad_bytes: int = 0        # .grad bytes of those layers' parameters (made at W)
    # the most of those one module's W makes at once: added into .grad already there, a transient
    deferred_grad_max_bytes: int = 0

    def out_new_bytes(self) -> int:
        return sum(b for b, o in zip(self.out_sig.group_bytes, self.out_origin) if o is None)


class LossLayer(nn.Module):
    """The loss as the last stage's extra layer: ``loss_fn(output, target) * weight``, as the engine
    computes it (:meth:`gpipe_repro.engine.stage.StageExecutor._loss`); of a ``(sum, count)`` loss, the
    sum (the engine scales it by a number, 1 / the mini-batch's count). The target is a buffer so that
    it is made fake with the layer; it is data, not counted as the layer's memory."""

    target: torch.Tensor    # a buffer (registered in __init__)

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], target: torch.Tensor,
                 weight: float = 1.0) -> None:
        super().__init__()
        self.loss_fn, self.weight = loss_fn, weight
        self.register_buffer("target", torch.empty(target.shape, dtype=target.dtype, device="meta"),
                             persistent=False)

    def forward(self, x: Any) -> torch.Tensor:
        loss = self.loss_fn(x, self.target)
        return (loss[0] if isinstance(loss, tuple) else loss) * self.weight

    def extra_repr(self) -> str:
        fn = getattr(self.loss_fn, "__qualname__", None) or repr(self.loss_fn)
        return f"loss_fn={fn}, target={tuple(self.target.shape)}:{self.target.dtype}"


class _InjectGrads(torch.autograd.Function):
    """Backward source: creates the output gradients inside the backward, like a next layer would."""

    @staticmethod
    def forward(ctx: Any, sink: dict[str, Any], *outputs: torch.Tensor) -> torch.Tensor:
        ctx.sink = sink
        ctx.meta = [(o.shape, o.dtype) for o in outputs]
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[Any, ...]:
        grads = tuple(torch.ones(shape, dtype=dtype) for shape, dtype in ctx.meta)
        tracker: MemoryTracker = ctx.sink["tracker"]
        ctx.sink["keys"] = [tracker.key_of(g) for g in grads]
        assert tracker.events is not None
        ctx.sink["start"] = len(tracker.events)
        return (None, *grads)


def _max_prefix(deltas: Iterable[int]) -> int:
    run = peak = 0
    for d in deltas:
        run += d
        peak = max(peak, run)
    return peak


def batchnorm_features(layer: nn.Module) -> int:
    """The features of the BatchNorms in `layer` whose running statistics a stage commits (the
    ones the engine makes DeferredBatchNorms)."""
    return sum(m.num_features for m in layer.modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
               and m.track_running_stats)


def commit_transient(features: int, micro_batches: int) -> int:
    """Bytes :func:`~gpipe_repro.engine.batchnorm.commit_many` allocates for a while when a stage
    commits the float32 statistics of BatchNorms with `features` in all, kept over `micro_batches`
    forwards: measured by running it on fake layers, as the runtime runs it on real ones (its
    temporaries grow with every layer's features at once)."""
    if features < 2 or micro_batches < 1:
        return 0
    mode, tracker = FakeTensorMode(), MemoryTracker(record_events=True)
    with mode:
        layers = [DeferredBatchNorm(n) for n in (features - features // 2, features // 2)]
        for bn in layers:
            bn._pending = [(2, torch.empty(bn.num_features), torch.empty(bn.num_features))
                           for _ in range(micro_batches)]
    with mode, tracker:
        commit_many(layers)
    assert tracker.events is not None
    return _max_prefix(delta for _, _, delta in tracker.events)


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())


def _nbytes(t: torch.Tensor) -> int:
    st = storage_of(t)
    return st.nbytes() if st is not None else t.numel() * t.element_size()


class _Profiler:
    """One profiling session of one layer (state shared by the passes)."""

    def __init__(self, layer: nn.Module, in_sig: ValueSig, optimizer: OptimizerFactory | None,
                 attention: str, flops: bool) -> None:
        require_one_of("attention", attention, ATTENTION)
        self.in_sig, self.optimizer, self.attention = in_sig, optimizer, attention
        self.count_flops = flops
        self.mode = FakeTensorMode()
        self.layer = DeferredBatchNorm.convert(fake_module(layer, self.mode))
        self.layer.train(layer.training)
        self.tracker = MemoryTracker(record_events=True)
        self.params = _unique_params(self.layer)
        # The inputs: one fake leaf per storage group (made outside the tracker: external).
        with self.mode:
            self.leaves: dict[int, torch.Tensor] = {}
            for leaf in in_sig.tensors:
                if leaf.group not in self.leaves:
                    self.leaves[leaf.group] = torch.empty(leaf.shape, dtype=leaf.dtype).requires_grad_(
                        leaf.requires_grad)

    def _attention(self) -> Any:
        if self.attention == "math":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            return sdpa_kernel([SDPBackend.MATH])
        return nullcontext()

    def _inputs(self, grad: bool) -> Any:
        """The layer's input: non-leaf clones of the leaves that require grad, as inside a cell."""
        def make(leaf: TensorSig) -> torch.Tensor:
            base = self.leaves[leaf.group]
            return base.clone() if grad and base.requires_grad else base.detach()
        with self.mode:
            return make_value(self.in_sig, make)

    def _window(self) -> int:
        assert self.tracker.events is not None
        return len(self.tracker.events)

    def _deltas(self, start: int) -> list[tuple[int, int]]:
        assert self.tracker.events is not None
        return [(key, delta) for key, _, delta in self.tracker.events[start:]]

    def forward_backward(self) -> dict[str, Any]:
        """A forward that keeps its graph, then the backward; returns what was measured."""
        x = self._inputs(grad=True)
        in_keys = {g: self.tracker.key_of(t) for g, t in
                   _group_tensors(x, self.in_sig).items()}
        saved: set[int | None] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.add(self.tracker.key_of(t))
            return t

        with ExitStack() as stack:
            stack.enter_context(self.mode)
            stack.enter_context(self._attention())
            stack.enter_context(self.tracker)
            flops = stack.enter_context(counting_flops()) if self.count_flops else None
            start = self._window()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = self.layer(x)
            fwd_flops = flops.get_total_flops() if flops is not None else 0
        fwd = self._deltas(start)
        born_alive = _alive(fwd)
        out_sig = value_sig(out)
        out_groups = _group_tensors(out, out_sig)
        origin = tuple(next((g for g, k in in_keys.items() if k == self.tracker.key_of(t)), None)
                       for _, t in sorted(out_groups.items()))
        out_keys = {self.tracker.key_of(t) for g, t in out_groups.items() if origin[g] is None}
        result: dict[str, Any] = {
            "out_sig": out_sig, "origin": origin, "fwd_peak": _max_prefix(d for _, d in fwd),
            "saved_in": frozenset(g for g, k in in_keys.items() if k in saved),
            "saved_out": frozenset(g for g, t in out_groups.items()
                                   if origin[g] is None and self.tracker.key_of(t) in saved),
            "saved_internal": sum(b for k, b in born_alive.items() if k in saved and k not in out_keys),
            "state_bytes": sum(b for k, b in born_alive.items() if k not in saved and k not in out_keys),
            "fwd_flops": fwd_flops}

        # Backward from gradients created inside it; nothing but the graph holds x or the output.
        rg = [t for t in {id(t): t for t in pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.requires_grad}.values()]
        group_of_key = {self.tracker.key_of(t): g for g, t in out_groups.items()}
        rg_groups = [group_of_key[self.tracker.key_of(t)] for t in rg]
        sink: dict[str, Any] = {"tracker": self.tracker}
        with self.mode, self.tracker:
            z = _InjectGrads.apply(sink, *rg) if rg else None
        del out, x, rg, out_groups
        if z is None:  # nothing to differentiate (e.g. an embedding of frozen weights)
            result.update(bwd=((0, 0), (0, 0)), in_grads=tuple(None for _ in self.in_sig.group_bytes),
                          grad_bytes=0, bwd_flops=0)
            return result
        with ExitStack() as stack:
            stack.enter_context(self.mode)
            stack.enter_context(self._attention())
            stack.enter_context(self.tracker)
            # a counter of its own: FlopCounterMode clears its counts each time it is entered
            flops = stack.enter_context(counting_flops()) if self.count_flops else None
            torch.autograd.backward(z)
        del z
        bwd_flops = flops.get_total_flops() if flops is not None else 0
        inject = set(sink["keys"])
        bwd = self._deltas(sink["start"])
        # Peaks for a layer inside a cell (everything freed as autograd frees it) and for a cell's
        # last layer (its output and incoming gradient stay held); and for a backward whose
        # parameters already have .grad: AccumulateGrad then adds each new gradient in place and
        # frees it at once (it runs as soon as the gradient exists: it has the highest priority).
        grad_keys = {self.tracker.key_of(p.grad) for p in self.params if p.grad is not None}
        held_out = [(k, d) for k, d in bwd if not (d < 0 and (k in inject or k in out_keys))]
        peaks = (_max_prefix(d for _, d in bwd), _max_prefix(d for _, d in held_out),
                 _max_prefix(_spikes(bwd, grad_keys)), _max_prefix(_spikes(held_out, grad_keys)))
        in_grads: list[tuple[str, int] | None] = []
        for g in range(len(self.in_sig.group_bytes)):
            leaf = self.leaves.get(g)
            grad = None if leaf is None else leaf.grad
            if grad is None:
                in_grads.append(None)
            elif self.tracker.key_of(grad) in inject:
                in_grads.append(("out", rg_groups[sink["keys"].index(self.tracker.key_of(grad))]))
            else:
                in_grads.append(("new", _nbytes(grad)))
        for leaf in self.leaves.values():
            leaf.grad = None
        result.update(bwd=((peaks[0], peaks[1]), (peaks[2], peaks[3])), in_grads=tuple(in_grads),
                      bwd_flops=bwd_flops,
                      grad_bytes=sum(_nbytes(p.grad) for p in self.params if p.grad is not None))
        return result

    def deferred_kept(self) -> tuple[int, int, int]:
        """What a zero-bubble split defers, as the engine defers it
        (:class:`~gpipe_repro.engine.backward_split.DeferredWeights` recording a forward, then its
        input half): (the bytes its weight half holds between the halves: each deferred layer's input
        and the gradient that reached its output, each storage once, as an input read by three
        projections or a gradient the residual stream passes to two layers; the gradient bytes of
        the parameters it defers; the most of those one layer makes at once). A layer the engine
        runs whole (a weight also read another way, a hook) is not counted. Every gradient this
        pass makes is dropped: the other measurements see the layer as they left it."""
        kept_grads = {id(q): q.grad for q in self.params}
        x = self._inputs(grad=True)
        storages: dict[int, int] = {}
        deferred: dict[int, int] = {}
        most = 0
        with self.mode, self._attention():
            deferral = DeferredWeights(self.layer)
            with deferral.recording() as work:
                out = self.layer(x)
            rg = [t for t in {id(t): t for t in pytree.tree_leaves(out)
                              if isinstance(t, torch.Tensor) and t.requires_grad}.values()]
            if rg:
                torch.autograd.backward(rg, [torch.ones_like(t) for t in rg])
            for entry in work.entries:
                for t in (entry.x, entry.grad):
                    st = storage_of(t) if t is not None else None
                    if st is not None:
                        storages[id(st)] = st.nbytes()
                own = {id(q): _nbytes(q) for q in (entry.weight, entry.bias)
                       if q is not None and q.requires_grad}
                deferred.update(own)
                most = max(most, sum(own.values()))
            deferral.release()
        for q in self.params:
            q.grad = kept_grads[id(q)]
        for leaf in self.leaves.values():
            leaf.grad = None
        return sum(storages.values()), sum(deferred.values()), most

    def forward_nograd(self) -> int:
        x = self._inputs(grad=False)
        with self.mode, self._attention(), self.tracker, torch.no_grad():
            start = self._window()
            out = self.layer(x)
        del out
        return _max_prefix(d for _, d in self._deltas(start))

    def optimizer_step(self) -> tuple[int, int]:
        """(optimizer state bytes, transient peak of a steady-state step). One step is run: the
        state it creates is what later steps find already there, so the steady-state transient is
        that step's peak without the state's own allocations."""
        with_grad = [p for p in self.params if p.grad is not None]
        if self.optimizer is None or not with_grad:
            return 0, 0
        with self.mode:
            opt = self.optimizer(with_grad)
        with self.mode, self.tracker:
            start = self._window()
            opt.step()
        step = self._deltas(start)
        state = {self.tracker.key_of(v) for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)}
        state_bytes = sum(_nbytes(v) for s in opt.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor))
        return state_bytes, _max_prefix(d for k, d in step if k not in state)


def _spikes(deltas: list[tuple[int, int]], keys: set[int | None]) -> Iterable[int]:
    """The deltas with each allocation of `keys` freed right after it is made."""
    for key, delta in deltas:
        if key in keys:
            if delta > 0:
                yield delta
                yield -delta
        else:
            yield delta


def _alive(deltas: list[tuple[int, int]]) -> dict[int, int]:
    """Storages born in a window and still alive at its end: key -> bytes."""
    alive: dict[int, int] = {}
    for key, delta in deltas:
        if delta > 0:
            alive[key] = delta
        else:
            alive.pop(key, None)
    return alive


def _group_tensors(value: Any, sig: ValueSig) -> dict[int, torch.Tensor]:
    """One tensor per storage group of `value` (whose signature is `sig`)."""
    out: dict[int, torch.Tensor] = {}
    for leaf, t in zip(sig.leaves, pytree.tree_leaves(value)):
        if isinstance(leaf, TensorSig) and leaf.group not in out:
            out[leaf.group] = t
    return out


class LayerNotTraceable(ValueError):
    """A layer whose step cannot run on fake tensors, so the planner cannot measure it."""


def profile_layer(layer: nn.Module, in_sig: ValueSig, optimizer: OptimizerFactory | None = rmsprop,
                  attention: str = "fused", flops: bool = False, name: str | None = None) -> LayerProfile:
    """Measure `layer` on an input of signature `in_sig` (see the module docstring). FLOPs are
    counted only with ``flops=True``, in a forward and backward of their own: under the FLOP
    counter a kernel may run another way (a LLaMA block's peak read 11% higher), and the memory
    figures must not depend on whether FLOPs were asked for. That pass counts as the engine does
    (:func:`gpipe_repro.engine.layer_costs.counting_flops`: attention by its math backend).

    Raises :class:`LayerNotTraceable`, naming the layer and the cause, where its forward, backward or
    optimizer step fails on fake tensors (a kernel whose output shape depends on the values, or
    whose fake version refuses the dtype: mixture-of-experts routing and grouped matmuls)."""
    p = _Profiler(layer, in_sig, optimizer, attention, False)
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)   # torch logs the failing op's traceback before raising
    try:
        first = p.forward_backward()
        nograd = p.forward_nograd()
        opt_state, opt_peak = p.optimizer_step()
        kept = grads = most = 0
        if any(deferrable(m) and getattr(m, "weight", None) is not None and m.weight.requires_grad
               for m in p.layer.modules()):
            kept, grads, most = p.deferred_kept()   # what the engine defers, measured
            if not any(t.requires_grad for t in p.leaves.values()):
                kept = 0        # the layer's input takes no gradient: a cell of it defers nothing
        counted = (_Profiler(layer, in_sig, optimizer, attention, True).forward_backward() if flops
                   else first)
    except Exception as e:  # noqa: BLE001 - any kernel's failure on fake tensors is the cause to name
        inner = getattr(layer, "block", None)
        what = type(layer).__name__ + (f" ({type(inner).__name__})" if isinstance(inner, nn.Module) else "")
        cause = " ".join(str(e).split())[:300]
        if is_one_value_per_channel(cause):
            raise LayerNotTraceable(
                f"{name or what} does not train on this micro-batch ({type(e).__name__}: {cause}): its "
                "BatchNorm needs more than one value per channel, so more examples per micro-batch "
                "(a smaller M or a larger batch)") from e
        raise LayerNotTraceable(
            f"{name or what} cannot be run on fake tensors ({type(e).__name__}: {cause}); the memory "
            "planner measures every layer without real data or memory, so a model with such a layer "
            "(e.g. mixture-of-experts routing or grouped matmuls) cannot be planned here") from e
    finally:
        fake_log.setLevel(level)
    original = _unique_params(layer)
    skip = {id(b) for m in layer.modules() if isinstance(m, LossLayer) for b in m.buffers()}
    return LayerProfile(
        name=name or type(layer).__name__, in_sig=in_sig, out_sig=first["out_sig"],
        out_origin=first["origin"], fwd_peak=first["fwd_peak"],
        saved_internal=first["saved_internal"], saved_in=first["saved_in"],
        saved_out=first["saved_out"], state_bytes=first["state_bytes"], nograd_peak=nograd,
        bwd_peak=first["bwd"], in_grads=first["in_grads"],
        param_bytes=sum(q.numel() * q.element_size() for q in original),
        buffer_bytes=sum(b.numel() * b.element_size() for b in layer.buffers() if id(b) not in skip),
        grad_bytes=first["grad_bytes"], opt_state_bytes=opt_state, opt_peak=opt_peak,
        fwd_flops=counted["fwd_flops"], bwd_flops=counted["bwd_flops"], has_flops=flops,
        deferred_bytes=kept, deferred_grad_bytes=grads, deferred_grad_max_bytes=most)


class ProfileCache:
    """Profiles keyed by (layer key, input signature, optimizer, attention): identical cells are
    traced once, across models too (a search over L reuses every profile)."""

    def __init__(self) -> None:
        self._store: dict[tuple[Any, ...], LayerProfile] = {}
        self.misses = 0

    def get(self, layer: nn.Module, in_sig: ValueSig, optimizer: OptimizerFactory | None,
            attention: str, flops: bool = False, key: tuple[Any, ...] | None = None) -> LayerProfile:
        """The profile of `layer` on `in_sig` (`key`: the layer's :func:`layer_key`, if known)."""
        full = (key if key is not None else layer_key(layer), in_sig, optimizer, attention)
        found = self._store.get(full)
        if found is None or (flops and not found.has_flops):
            self.misses += 1
            found = self._store[full] = profile_layer(layer, in_sig, optimizer, attention, flops)
        return found

    def __len__(self) -> int:
        return len(self._store)
