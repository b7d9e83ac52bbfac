"""Losses whose mean is not a per-example mean, made exact under micro-batching.

The pipeline combines micro-batch losses with weights n_m / N (a ``reduction="mean"`` loss) or 1
(``"sum"``), which is the full-batch loss when the loss averages over examples. ``nn.CrossEntropyLoss``
and ``nn.NLLLoss`` with class-index targets do not: their mean divides by the sum of the weights of
the targets that count, ``sum_i w[y_i]`` over targets other than ``ignore_index`` (PyTorch's
documentation of both losses, "reduction='mean'"), so a micro-batch with more padding, or with
rarer classes, weighs differently than its share of rows. :func:`exact_mean` turns such a loss into
the ``(sum, count)`` form the engine sums over micro-batches (and ranks): the summed loss and that
denominator, so the step's loss and gradients are the full batch's, padding and class weights
included.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["exact_mean", "SumAndCount"]


class SumAndCount(nn.Module):
    """``loss(output, target) -> (sum, count)`` for an ``nn.CrossEntropyLoss`` or ``nn.NLLLoss`` with
    ``reduction="mean"`` (the original, kept as :attr:`loss`): the loss with ``reduction="sum"`` and
    the denominator PyTorch's mean divides by."""

    def __init__(self, loss: nn.CrossEntropyLoss | nn.NLLLoss) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = self.loss
        weight = loss.weight
        if isinstance(loss, nn.CrossEntropyLoss):
            total = F.cross_entropy(output, target, weight=weight, ignore_index=loss.ignore_index,
                                    reduction="sum", label_smoothing=loss.label_smoothing)
        else:
            total = F.nll_loss(output, target, weight=weight, ignore_index=loss.ignore_index,
                               reduction="sum")
        if target.is_floating_point():   # class probabilities (N, C, ...): the mean is over N, ...
            positions = target.numel() // target.shape[1] if target.dim() > 1 else 1
            return total, torch.tensor(float(positions), dtype=total.dtype, device=total.device)
        kept = target != loss.ignore_index
        if weight is None:
            count = kept.sum().to(total.dtype)
        else:
            count = weight.to(total.device)[target.masked_select(kept)].sum().to(total.dtype)
        return total, count


def exact_mean(loss_fn: Any) -> Any:
    """`loss_fn` as the pipeline should call it: a ``reduction="mean"`` ``nn.CrossEntropyLoss`` or
    ``nn.NLLLoss`` becomes :class:`SumAndCount` (see the module docstring); anything else is
    returned as it is."""
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and loss_fn.reduction == "mean":
        return SumAndCount(loss_fn)
    return loss_fn
