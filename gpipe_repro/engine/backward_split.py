"""The zero-bubble split of a backward (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
its input half now (BACKWARD_INPUT), its weight half later (BACKWARD_WEIGHT), as the stage executor
runs them and the calibration times them (:mod:`gpipe_repro.sim.calibration.timing`).

The split is made in the forward, as the paper's own implementation (in Megatron-LM) makes it:
while a micro-batch's forward runs under :meth:`DeferredWeights.recording`, each linear or
convolution layer whose weight is a plain leaf parameter computes its output from its weight (and
bias) *detached*, keeps its input, and keeps the gradient that arrives at its product in the
backward (a pre-hook on the product's node, which the output is or views: after any hook on the
output, as the layer's own backward would receive it). BACKWARD_INPUT is then plain autograd's
backward of the cell, which no longer reaches those weights; BACKWARD_WEIGHT (:class:`WeightWork`)
computes their gradients from the kept pairs, one matrix product (a convolution's weight kernel)
each, and adds them into ``p.grad``.

Sound by construction: everything that is not deferred keeps its gradient path, and gets its gradient
in BACKWARD_INPUT exactly as plain training's backward gives it: a norm's parameters, an embedding, a
weight used a second way (tied), a tensor a layer captured, another cell's weight a loss reads, a
custom ``autograd.Function``. Only the deferred products move to later. No walk of the autograd graph
(PyTorch pipelining groups parameters by walking it per micro-batch, which on small layers costs more
than the backward: see docs/schedules.md).

A layer is deferred where this call of its ``forward`` is exactly the class's (``nn.Linear``,
``nn.Conv1d/2d/3d`` with zero padding given as numbers, Hugging Face's GPT-2 ``Conv1D``; a subclass
that overrides ``forward``, or an instance whose ``forward`` was replaced, is left alone), its weight
is a leaf that requires a gradient and has no hooks (a weight read another way too gets its gradient
in two shares, at I and at W, and a hook would run on each: :data:`SHARES_SAFE`), its input
requires a gradient and has the weight's dtype (or autocast casts both, as it would), a convolution
runs on a batch, and no saved-tensor hooks are active (:func:`_saving_hooks`). Anything else runs
as written. Not run for a deferred weight: hooks registered on its AccumulateGrad node (torch DDP's
way), and node pre-hooks a user registers on the layer's output node itself; a backward with
``create_graph=True`` through a deferred layer (second derivatives) is refused by name.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.utils import parametrize

from gpipe_repro.engine import boundary

__all__ = ["DeferredWeights", "WeightWork", "SHARES_SAFE", "deferrable", "full_backward",
           "needs_whole_gradient", "splits_input", "takes_gradient"]


class WeightWork:
    """One micro-batch's BACKWARD_WEIGHT: the deferred layers' parameter gradients, computed from the
    inputs and output gradients kept in its forward and BACKWARD_INPUT."""

    def __init__(self) -> None:
        self.entries: list[_Deferred] = []

    def __call__(self) -> None:
        """Compute the deferred gradients and add them into ``p.grad`` one layer at a time (so no
        more than one layer's new gradients exist at once), as autograd's AccumulateGrad adds them
        (the first one kept in the parameter's layout). A parameter that has hooks gets this
        micro-batch's sum through autograd, once, so its hooks run once, as in plain training."""
        entries, self.entries = self.entries, []
        hooked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for entry in entries:
            for p, g in entry.gradients():
                if _any_hooks(p):
                    known = hooked.get(id(p))
                    hooked[id(p)] = (p, g if known is None else known[1] + g)
                    continue
                with torch.no_grad():
                    if p.grad is None:
                        p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
                    elif p.grad.layout != torch.strided:    # a sparse share from I (a tied embedding)
                        p.grad = g + p.grad
                    else:
                        p.grad += g
        if hooked:
            torch.autograd.backward([p for p, _ in hooked.values()], [g for _, g in hooked.values()])


class DeferredWeights:
    """The deferrable layers of one cell, and the forward that defers their weight gradients."""

    def __init__(self, cell: nn.Module) -> None:
        """What can defer is decided here, from the parameters as they are now (a stage builds one
        per step): the per-call checks are on the input only."""
        self._layers: list[tuple[nn.Module, _Layer]] = []
        for module in cell.modules():
            kind = _kind(module)
            if kind is not None and _eligible(module, kind):
                self._layers.append((module, _Layer(module, kind)))

    def release(self) -> None:
        """Let go of the layers' detached and cast weights (:meth:`_Layer.release`)."""
        for _, layer in self._layers:
            layer.release()

    @contextmanager
    def recording(self) -> Iterator[WeightWork]:
        """Run a forward in this block with the cell's deferrable layers deferring their weight
        gradients into the :class:`WeightWork` it yields (this thread's calls only: a module shared
        with another thread's cell runs as written there)."""
        work = WeightWork()
        installed = []
        for module, layer in self._layers:
            if "forward" not in module.__dict__:      # not replaced by someone else
                wrapper = layer.forward
                module.__dict__["forward"] = wrapper
                installed.append((module, wrapper))
        previous = getattr(_ACTIVE, "work", None)
        _ACTIVE.work = work
        try:
            yield work
        finally:
            _ACTIVE.work = previous
            for module, wrapper in installed:
                if module.__dict__.get("forward") == wrapper:
                    del module.__dict__["forward"]


_ACTIVE = threading.local()


class _Deferred:
    """One deferred call: its layer's parameters, the input it read (as the product used it), the
    gradient that reached its output (None until the input half passes it), and how to turn the two
    into the parameters' gradients."""

    def __init__(self, module: nn.Module, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, kernel: Callable[..., list[torch.Tensor | None]],
                 arguments: tuple[Any, ...]) -> None:
        self.module, self.x, self.version = module, x, x._version
        self.weight, self.bias = weight, bias
        self.kernel, self.arguments = kernel, arguments
        self.grad: torch.Tensor | None = None

    def keep(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        if torch.is_grad_enabled():       # a backward with create_graph=True
            raise RuntimeError(
                f"a backward with create_graph=True (a gradient penalty, an input gradient taken "
                f"inside the model) passed through a {type(self.module).__name__} whose weight "
                "gradient the zero-bubble schedule defers; its second derivative would miss the "
                "weight: train this model with a schedule that does not split the backward "
                "(schedule='1f1b', 'gpipe' or 'interleaved')")
        self._check()
        self.grad = grad_outputs[0]

    def _check(self) -> None:
        if self.x._version != self.version:
            raise RuntimeError(
                f"the input of a {type(self.module).__name__} was modified in place after the layer read "
                "it, and its weight's gradient needs it as it was (plain autograd fails the same "
                "way): compute the in-place operation out of place (x = x.relu() for x.relu_())")

    def gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.grad is None:                 # no gradient reached this output
            return []
        self._check()
        with torch.no_grad():
            got = self.kernel(self.x, self.grad, self.bias is not None, *self.arguments)
        out = []
        for p, g in zip((self.weight, self.bias), got):
            if p is not None and g is not None:
                out.append((p, g if g.dtype == p.dtype else g.to(p.dtype)))
        self.x = self.grad = None             # type: ignore[assignment]
        return out


SHARES_SAFE = "_gpipe_counts_shares"
"""An attribute a post-accumulate-grad hook's function may carry (True) to say it is right when the
parameter's gradient arrives in two shares, at I and at W: the data-parallel reducer's, which counts
only during a stage's last backward action, always a W. Any other hook keeps its parameter out of
the deferral."""


def _any_hooks(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None))


def needs_whole_gradient(p: torch.Tensor) -> bool:
    """Whether `p` has a hook that must see its whole gradient of a micro-batch at once (any but
    one marked :data:`SHARES_SAFE`)."""
    if getattr(p, "_backward_hooks", None):
        return True
    post = getattr(p, "_post_accumulate_grad_hooks", None) or {}
    return any(not getattr(h, SHARES_SAFE, False) for h in post.values())


def _storage_key(t: torch.Tensor) -> int:
    """What changes when a tensor's ``.data`` is replaced: its data pointer (a fake tensor has none:
    the planner's fake layers are never given new data)."""
    return id(t) if type(t) is FakeTensor else t.data_ptr()


#: An input's types a deferred layer takes: a plain tensor, or a fake one (the memory planner runs
#: the engine on fake tensors, and it must defer there as on real ones).
_PLAIN = (torch.Tensor, FakeTensor)


def _trainable_leaf(t: Any) -> bool:
    """A plain leaf that requires a gradient and has no hook that must see its whole gradient (a
    weight read by a deferred layer and also another way gets its gradient in two shares, at I and
    at W; a hook would run on each). A fake one too (the memory planner runs the engine on fake
    tensors: it must defer there as it does on real ones)."""
    return (type(t) in (*_PLAIN, nn.Parameter) and t.is_leaf
            and t.requires_grad and t.layout == torch.strided and not needs_whole_gradient(t))


_CONV = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}


def _kind(module: nn.Module) -> str | None:
    """"linear", "conv" or "gpt2-conv1d" where `module`'s class forward is one of the known ones."""
    forward = type(module).forward
    if forward is nn.Linear.forward:
        return "linear"
    if any(forward is cls.forward and getattr(type(module), "_conv_forward", None) is cls._conv_forward
           and isinstance(module, cls) for cls in _CONV):
        return "conv"
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if conv1d is not None and forward is conv1d.forward:
        return "gpt2-conv1d"
    return None


def _eligible(module: nn.Module, kind: str) -> bool:
    # a parametrized weight (spectral_norm, weight_norm, orthogonal) is computed by reading it, and a
    # spectral norm's read in training advances its power iteration: never read it here, never defer
    if parametrize.is_parametrized(module):
        return False
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if weight is None or not _trainable_leaf(weight):
        return False
    if bias is not None and (type(bias) not in (*_PLAIN, nn.Parameter)
                             or bias.dtype != weight.dtype
                             or (bias.requires_grad and not _trainable_leaf(bias))):
        return False
    return kind != "gpt2-conv1d" or bias is not None


def deferrable(module: nn.Module) -> bool:
    """Whether `module`'s class is one whose weight gradients a split forward defers (whether a call
    does depends on its parameters and tensors: see the module docstring)."""
    return _kind(module) is not None


class _Layer:
    """One deferrable module's forward while a cell records: the product on its weight (and bias)
    detached, its input and output kept for the weight half (:class:`_Deferred`); the module's own
    forward where this call cannot defer (no recording in this thread, no gradient, an input that
    takes none or of another dtype, keyword arguments). The detached (or autocast's cast) weight is
    made once and reused while the weight is unchanged (its version counter)."""

    def __init__(self, module: nn.Module, kind: str) -> None:
        self.module, self.kind = module, kind
        self.weight: torch.Tensor = module.weight  # type: ignore[assignment]  # checked: _eligible
        self.bias: torch.Tensor | None = module.bias  # type: ignore[assignment]
        self.grad_bias = self.bias if self.bias is not None and self.bias.requires_grad else None
        self.device = self.weight.device.type
        self.own = type(module).forward
        self._copies: dict[torch.dtype | None, tuple[Any, torch.Tensor, torch.Tensor | None]] = {}
        if kind == "conv":
            self.conv: Callable[..., torch.Tensor] = next(
                f for cls, f in _CONV.items() if isinstance(module, cls))

    def _detached(self, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias detached (autocast: cast), made again where either changed: in place
        (its version), or its ``.data`` replaced (its storage)."""
        version = (self.weight._version, _storage_key(self.weight),
                   None if self.bias is None else (self.bias._version, _storage_key(self.bias)))
        known = self._copies.get(dtype)
        if known is not None and known[0] == version:
            return known[1], known[2]
        w = self.weight.detach()
        b = self.bias.detach() if self.bias is not None else None
        if dtype is not None:
            w = w.to(dtype)
            b = b.to(dtype) if b is not None else None
        self._copies[dtype] = (version, w, b)
        return w, b

    def _dtype(self, x: torch.Tensor) -> torch.dtype | None | bool:
        """The dtype the product runs in (None: the tensors' own), or False: as written."""
        if torch.is_autocast_enabled(self.device):
            cast = torch.get_autocast_dtype(self.device)
            if self.weight.dtype != torch.float32 or x.dtype not in (torch.float32, cast):
                return False
            return cast
        return None if x.dtype == self.weight.dtype else False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        work: WeightWork | None = getattr(_ACTIVE, "work", None)
        x = args[0] if len(args) == 1 and not kwargs else None
        own = self.module._parameters        # the parameters it was built with, still the module's
        dtype = (self._dtype(x) if work is not None and isinstance(x, torch.Tensor) and type(x) in _PLAIN
                 and x.requires_grad
                 and torch.is_grad_enabled() and x.is_floating_point() and not _saving_hooks()
                 and own.get("weight") is self.weight and own.get("bias") is self.bias
                 and x.layout == torch.strided and self._supports(x) else False)
        if dtype is False:
            return self.own(self.module, *args, **kwargs)
        assert work is not None and x is not None and (dtype is None or isinstance(dtype, torch.dtype))
        xs = x if dtype is None or x.dtype == dtype else x.to(dtype)
        w, b = self._detached(dtype)
        kernel: Callable[..., list[torch.Tensor | None]]
        arguments: tuple[Any, ...] = ()
        if self.kind == "linear":
            y = F.linear(xs, w, b)
            kernel = _linear_kernel
        elif self.kind == "conv":
            m = self.module
            geometry = (m.stride, m.padding, m.dilation, m.groups)
            y = self.conv(xs, w, b, *geometry)
            kernel, arguments = _convolution_kernel, (w, *geometry)
        else:
            assert b is not None
            y = torch.addmm(b, xs.view(-1, xs.size(-1)), w).view(xs.size()[:-1] + (w.shape[1],))
            kernel = _conv1d_kernel
        # the input without its history: kept with its grad_fn, it kept the autograd nodes before it
        # alive until W, and through them the cell's received input and its gradient
        entry = _Deferred(self.module, xs.detach(), self.weight, self.grad_bias, kernel, arguments)
        # The product's own node: where the output is a view of it (a linear layer's on more than
        # two dimensions, GPT-2's Conv1D), an in-place operation on the output rebases the view's
        # history and its node never runs.
        product = y._base if y._base is not None else y
        assert product.grad_fn is not None
        product.grad_fn.register_prehook(entry.keep)
        work.entries.append(entry)
        return y

    def _supports(self, x: torch.Tensor) -> bool:
        """Whether the call's form is one the weight half computes: a convolution on a batch (an
        unbatched input is a squeezed view, and the weight kernel wants the batch dimension) with
        zero padding given as numbers (as the module says now)."""
        if self.kind != "conv":
            return True
        m = self.module
        return (x.dim() == self.weight.dim() and m.padding_mode == "zeros"
                and not isinstance(m.padding, str))

    def release(self) -> None:
        """Let go of the detached and cast weights (before the optimizer step: no cast copy outlives
        the step, as autocast's own do not)."""
        self._copies.clear()


def _saving_hooks() -> bool:
    """Whether saved-tensor hooks are active (``torch.autograd.graph.saved_tensors_hooks``: a
    non-reentrant activation checkpoint, an offload to the CPU). A layer then runs as written: a
    checkpoint recomputes it in the backward, after the recording, and requires the recomputation to
    save what the forward saved; an offload would not move the input a deferred layer keeps."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def _linear_kernel(x: torch.Tensor, g: torch.Tensor, with_bias: bool) -> list[torch.Tensor | None]:
    g2 = g.reshape(-1, g.shape[-1])
    return [g2.t() @ x.reshape(-1, x.shape[-1]), g2.sum(0) if with_bias else None]


def _conv1d_kernel(x: torch.Tensor, g: torch.Tensor, with_bias: bool) -> list[torch.Tensor | None]:
    """GPT-2's Conv1D: y = bias + x @ weight, weight (in, out)."""
    g2 = g.reshape(-1, g.shape[-1])
    return [x.reshape(-1, x.shape[-1]).t() @ g2, g2.sum(0) if with_bias else None]


def _convolution_kernel(x: torch.Tensor, g: torch.Tensor, with_bias: bool, weight: torch.Tensor,
                        stride: Any, padding: Any, dilation: Any, groups: int
                        ) -> list[torch.Tensor | None]:
    _, gw, gb = torch.ops.aten.convolution_backward(
        g, x, weight, [weight.shape[0]] if with_bias else None, list(stride), list(padding),
        list(dilation), False, [0] * len(stride), groups, [False, True, with_bias])
    return [gw, gb]


def takes_gradient(x: Any) -> bool:
    """Whether a value fed to a cell or layer has a floating tensor that takes a gradient: a split of
    its backward has an input half (a cell whose input is integers only runs its whole backward at
    W)."""
    return any(boundary.carries_grad(t) and t.requires_grad for t in boundary.tensors(x))


def splits_input(x: Any, stage: int) -> bool:
    """Whether the backward of a cell on input `x` has an input half to split off: a stage 0, whose
    input is the model's, runs its whole backward at W, as does a cell whose input takes no gradient
    (:func:`takes_gradient`)."""
    return stage > 0 and takes_gradient(x)


def full_backward(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[], None]:
    """The whole backward of `outs`, to run later (BACKWARD_WEIGHT of a cell with no input
    gradient)."""
    def run() -> None:
        torch.autograd.backward(outs, grads)
    return run
