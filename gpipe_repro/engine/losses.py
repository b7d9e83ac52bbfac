"""The last stage's loss: each micro-batch's loss weighted for the backward, and losses whose mean is
not a per-row mean made exact under micro-batching.

:func:`weighted_loss` is what the last stage computes per micro-batch: ``loss_fn(output, targets)``,
a 0-dim tensor or ``(sum, count)``, checked, upcast to float32 (:func:`~.precision.upcast`) and
multiplied by the micro-batch's weight (n_m / N for a mean loss, 1 for a sum or a ``(sum, count)``
loss, whose counts the stages agree on at AGREE).

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
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.precision import upcast

__all__ = ["exact_mean", "denominator", "weighted_loss", "loss_weights"]

_MeanLoss = nn.CrossEntropyLoss | nn.NLLLoss


def denominator(loss: _MeanLoss, target: torch.Tensor) -> torch.Tensor:
    """What `loss`'s ``reduction="mean"`` divides by for `target`, as a 0-dim float64 tensor (no host
    read): the summed class weight of the targets other than ``ignore_index`` (their count without
    ``weight``); for class probabilities (floating targets, N x C x ...), the number of positions
    N x ...."""
    if target.is_floating_point():
        return _number(target.numel() // target.shape[1] if target.dim() > 1 else 1, target)
    if target.device.type == "meta" or type(target).__name__ == "FakeTensor":
        return _number(target.numel(), target)   # shapes only (the memory planner's trace)
    kept = target != loss.ignore_index
    if loss.weight is None:
        return kept.sum(dtype=torch.float64)   # a count: exact in float64
    return loss.weight.to(target.device)[target.masked_select(kept)].sum().double()


def _number(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float(n), dtype=torch.float64, device=like.device)


def exact_mean(loss_fn: Any) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor] | None]:
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


def weighted_loss(result: Any, weight: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a micro-batch's ``loss_fn`` returned (`result`) as the backward's seed, weighted by
    `weight` (ignored for ``(sum, count)``), and its count (None for a plain loss). Raises TypeError,
    saying what to return, for anything but a 0-dim tensor or ``(sum, count)``."""
    count = None
    if isinstance(result, tuple):
        if len(result) != 2:
            raise TypeError(f"loss_fn returned a tuple of {len(result)}; return a scalar tensor or "
                            "(sum, count): the micro-batch's summed loss and what it counts "
                            "(e.g. its non-padding tokens)")
        result, count = result
    if not isinstance(result, torch.Tensor) or result.dim() != 0:
        raise TypeError("loss_fn must return a scalar tensor (0-dim) or (sum, count); use a "
                        "reducing loss")
    loss = upcast(result)
    if count is None and not (isinstance(weight, float) and weight == 1.0):   # x * 1.0 is x
        loss = loss * weight
    return loss, None if count is None else torch.as_tensor(count, dtype=torch.float64).detach()


def loss_weights(sizes: Sequence[int], targets: Sequence[Any], reduction: str,
                 denominator: Callable[[Any], torch.Tensor] | None) -> list[float | torch.Tensor]:
    """Each micro-batch's loss weight: n_m / N for a ``"mean"`` loss, 1 for ``"sum"``, and 1 / the
    mini-batch's denominator for a loss :func:`exact_mean` split, a 0-dim tensor (NaN when the
    denominator is 0: every target ignored, as PyTorch's mean)."""
    n = sum(sizes)
    if denominator is not None:   # summed losses over the mini-batch's denominator
        parts = [denominator(t) for t in targets]
        total = parts[0]
        for part in parts[1:]:
            total = total + part.to(total.device)
        # 1 / total, NaN for 0 (0/0); a positive count c gives c/c = 1 exactly, then 1/c
        weight = total.div(total).div_(total)
        return [weight] * len(sizes)
    return [s / n for s in sizes] if reduction == "mean" else [1.0] * len(sizes)
