"""Losses whose mean is not a per-row mean, made exact under micro-batching.

The pipeline combines micro-batch losses with weights n_m / N (a ``reduction="mean"`` loss) or 1
(``"sum"``), which is the full-batch loss when the loss averages over rows. ``nn.CrossEntropyLoss``
and ``nn.NLLLoss`` with class-index targets do not: their mean divides by the summed weight of the
targets that count, ``sum_i w[y_i]`` over targets other than ``ignore_index`` (PyTorch's
documentation of both losses, "reduction='mean'"), so a micro-batch with more padding, or with
rarer classes, weighs differently than its share of rows.

:func:`exact_mean` splits such a loss into what each micro-batch computes, its summed loss (the same
loss with ``reduction="sum"``), and the mini-batch's denominator (:func:`denominator`, summed over
every micro-batch before the step: every rank holds the whole mini-batch). Each micro-batch's sum is
then weighted by 1 / that denominator, so the step's loss and gradients are the full batch's,
padding and class weights included, and the gradients flowing back have the mean's magnitude (a sum
form would scale them by the batch, which fp16's loss scale would pay for). A mini-batch whose every
target is ignored has a NaN loss, as PyTorch's.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["exact_mean", "denominator"]

_MeanLoss = nn.CrossEntropyLoss | nn.NLLLoss


def denominator(loss: _MeanLoss, target: torch.Tensor) -> float:
    """What `loss`'s ``reduction="mean"`` divides by for `target`: the summed class weight of the
    targets other than ``ignore_index`` (their count without ``weight``); for class probabilities
    (floating targets, N x C x ...), the number of positions N x ...."""
    if target.is_floating_point():
        return float(target.numel() // target.shape[1]) if target.dim() > 1 else 1.0
    if target.device.type == "meta" or type(target).__name__ == "FakeTensor":
        return float(target.numel())    # shapes only (the memory planner's trace): no values to read
    kept = target != loss.ignore_index
    if loss.weight is None:
        return float(kept.sum())
    return float(loss.weight.to(target.device)[target.masked_select(kept)].sum())


def exact_mean(loss_fn: Any) -> tuple[Any, Callable[[torch.Tensor], float] | None]:
    """`loss_fn` as the stages should call it, and the denominator function of the mini-batch's
    targets: ``(the loss with reduction="sum", denominator)`` for a ``reduction="mean"``
    ``nn.CrossEntropyLoss`` or ``nn.NLLLoss`` (see the module docstring); ``(loss_fn, None)`` for
    anything else: a subclass with its own ``forward`` (a focal loss, an added term) is the user's
    computation and runs as given, weighted n_m / N as any mean loss; so does a function wrapping
    cross-entropy. Where such a mean depends on padding or class weights, return ``(sum, count)``
    to make it exact."""
    stock = getattr(type(loss_fn), "forward", None) in (nn.CrossEntropyLoss.forward, nn.NLLLoss.forward)
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and stock and loss_fn.reduction == "mean":
        summed = copy.copy(loss_fn)        # the same loss (weights shared), summing
        summed.reduction = "sum"
        return summed, lambda target: denominator(loss_fn, target)
    return loss_fn, None
