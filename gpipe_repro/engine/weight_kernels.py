"""A zero-bubble weight half without the autograd engine, where one node of a known kind is all there
is to run: the node's own weight-gradient kernel, called on the tensors the forward saved and the
gradient the input half kept for it.

Why: the weight half runs one autograd call per group of parameters (PyTorch pipelining's
``stage_backward_weight``), and on a CPU each call costs a fixed share (the graph task, its walk of
the graph below the starting node, the Python around it) that is about as large as a small kernel:
on a convolutional net with BatchNorm, whose every convolution and every norm is a group of its own,
the weight half cost as much as a whole backward. Most groups are one convolution, one BatchNorm or
LayerNorm, or one linear layer (addmm or mm, the weight behind a transpose), whose parameters hang
off the node (:data:`KERNELS`); for those, the
kernel is called with a mask that asks for the parameters' gradients only, and the gradients are
accumulated into ``p.grad`` as AccumulateGrad does. Any other group goes through autograd as before
(:func:`run_direct` leaves it in place), and so does a parameter with a hook (the kernel would not
run it).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["KERNELS", "run_direct"]


def _convolution(node: Any, grad: torch.Tensor, mask: list[bool]) -> Sequence[torch.Tensor | None]:
    return torch.ops.aten.convolution_backward(
        grad, node._saved_input, node._saved_weight, node._saved_bias_sym_sizes_opt, node._saved_stride,
        node._saved_padding, node._saved_dilation, node._saved_transposed, node._saved_output_padding,
        node._saved_groups, mask)


def _batch_norm(node: Any, grad: torch.Tensor, mask: list[bool]) -> Sequence[torch.Tensor | None]:
    return torch.ops.aten.native_batch_norm_backward(
        grad, node._saved_input, node._saved_weight, node._saved_running_mean, node._saved_running_var,
        node._saved_result1, node._saved_result2, node._saved_training, node._saved_eps, mask)


def _layer_norm(node: Any, grad: torch.Tensor, mask: list[bool]) -> Sequence[torch.Tensor | None]:
    return torch.ops.aten.native_layer_norm_backward(
        grad, node._saved_input, node._saved_normalized_shape, node._saved_result1, node._saved_result2,
        node._saved_weight, node._saved_bias, mask)


def _scaled(t: torch.Tensor, factor: Any) -> torch.Tensor:
    return t if factor == 1 else t * factor


def _addmm(node: Any, grad: torch.Tensor, mask: list[bool]) -> Sequence[torch.Tensor | None]:
    """beta * self + alpha * mat1 @ mat2 (a linear layer with a bias: self the bias, mat2 its weight
    transposed). mat2's gradient is made as the transpose of a contiguous product, so that the weight's,
    its transpose, is contiguous like the weight."""
    mat1, mat2, alpha = node._saved_mat1, node._saved_mat2, node._saved_alpha
    return (_scaled(grad, node._saved_beta) if mask[0] else None,
            _scaled(grad @ mat2.t(), alpha) if mask[1] else None,
            _scaled((grad.t() @ mat1).t(), alpha) if mask[2] else None)


def _mm(node: Any, grad: torch.Tensor, mask: list[bool]) -> Sequence[torch.Tensor | None]:
    """self @ mat2 (a linear layer without a bias: mat2 its weight transposed)."""
    return (grad @ node._saved_mat2.t() if mask[0] else None,
            (grad.t() @ node._saved_self).t() if mask[1] else None)


KERNELS: dict[str, Callable[[Any, torch.Tensor, list[bool]], Sequence[torch.Tensor | None]]] = {
    "ConvolutionBackward0": _convolution,
    "NativeBatchNormBackward0": _batch_norm,
    "NativeLayerNormBackward0": _layer_norm,
    "AddmmBackward0": _addmm,
    "MmBackward0": _mm,
}
"""Node kind -> its kernel (node, incoming gradient, output mask over the node's next edges)."""


def _hooked(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None))


def _direct(group: dict[str, Any]) -> bool:
    """Run `group` (PyTorch pipelining's parameter group, its kept gradients in ``grads``) by its
    node's kernel; False, nothing done, where it is not one node of a known kind with the group's
    parameters (and nothing else wanted) on its next edges."""
    if len(group["intermediates"]) != 1:
        return False
    node, kept = group["intermediates"][0], group["grads"][0]
    kernel = KERNELS.get(type(node).__name__)
    if kernel is None or kept is None or len(kept) != 1 or kept[0] is None:
        return False
    params = group["params"]
    found = [_parameter_behind(fn, params) for fn, _ in node.next_functions]
    wanted = [f is not None for f in found]
    if sum(wanted) != len(params):
        return False
    if any(f is not None and _hooked(f[0]) for f in found):
        return False
    grads = kernel(node, kept[0], wanted)
    for f, g in zip(found, grads):
        if f is None or g is None:
            continue
        p, transposed = f
        g = g.t() if transposed else g
        g = g if g.shape == p.shape else g.sum_to_size(p.shape)
        if p.grad is None:   # in the parameter's layout, as AccumulateGrad keeps it (GPT-2's Conv1D
            p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)   # weight is mat2)
        else:
            p.grad += g
    return True


def _parameter_behind(fn: Any, params: Any) -> tuple[torch.Tensor, bool] | None:
    """The group's parameter an edge reaches, and whether through a transpose (a linear layer's
    weight), or None."""
    if fn is None:
        return None
    if fn in params:
        return fn.variable, False
    if type(fn).__name__ == "TBackward0" and fn.next_functions[0][0] in params:
        return fn.next_functions[0][0].variable, True
    return None


def run_direct(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run every group of `groups` that a kernel can (:data:`KERNELS`); the others, in order, for the
    autograd engine. A group run here lets go of its graph and gradients."""
    left = []
    for group in groups:
        with torch.no_grad():
            done = _direct(group)
        if done:
            group["intermediates"], group["grads"] = [], []
        else:
            left.append(group)
    return left
