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

A loss that declares no reduction (a function, or a module without ``.reduction``) and returns a
0-dim tensor is combined as a mean over rows unless the caller says otherwise (``loss_reduction=``).
That assumption is checked during the first step (:class:`UndeclaredReduction`), because
when it is wrong the step silently differs from full-batch training: a summing function would train
on half the loss at M=2, and a function's mean over the targets that count (``F.cross_entropy`` with
padding marked -100) weighs a micro-batch by its rows, not by its tokens.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.precision import upcast

__all__ = ["exact_mean", "denominator", "weighted_loss", "loss_weights", "UndeclaredReduction",
           "refuse_ignored_targets", "IGNORED_TARGET"]

IGNORED_TARGET = -100
"""The class index ``F.cross_entropy`` and ``F.nll_loss`` ignore by default (and transformers' labels
use for padding)."""

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


class UndeclaredReduction:
    """`loss_fn`, whose reduction nobody declared, checked over its first `checked_calls` calls (the
    caller gives two steps' worth: a micro-batch's loss may be computed again at its recompute) to
    be the per-row mean the pipeline then assumes (see the module docstring), wherever it returns a
    0-dim tensor (a ``(sum, count)`` result is exact and ends the checks):

    - integer targets holding :data:`IGNORED_TARGET`: a function's mean over the targets that count
      (``F.cross_entropy``'s) would weigh each micro-batch by its rows, not by its counted targets;
    - on the first call, its first row repeated twice must give that row's loss again: a sum gives
      twice it (pass ``loss_reduction="sum"``), and a loss that is neither a mean nor a sum over
      rows is changed by micro-batching (``loss_reduction`` accepts combining micro-batches as
      given). A probe that cannot run (a tuple output, rows that do not match the target's, a loss
      that fails on other row counts) checks nothing.

    Each raises ValueError saying what to change; the micro-batch's loss is not used, so the step
    changes nothing. Each targets check reads the device once, during the first step only."""

    def __init__(self, loss_fn: Callable[..., Any], checked_calls: int) -> None:
        self.loss_fn = loss_fn
        self.calls_left = checked_calls
        self.probed = False

    def __call__(self, output: Any, target: Any) -> Any:
        result = self.loss_fn(output, target)
        if self.calls_left > 0:
            self.calls_left -= 1
            if not (isinstance(result, torch.Tensor) and result.dim() == 0):
                self.calls_left = 0     # (sum, count): exact whatever the targets
                return result
            refuse_ignored_targets(target)
            if not self.probed:
                self.probed = True
                self._probe_rows(output, target)
        return result

    def _probe_rows(self, output: Any, target: Any) -> None:
        if not (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)) or \
                not _real(output) or not _real(target) or output.dim() == 0 or target.dim() == 0 or \
                output.shape[0] != target.shape[0]:
            return
        with torch.no_grad():
            try:
                one = self.loss_fn(output[:1].detach(), target[:1])
                two = self.loss_fn(torch.cat([output[:1].detach()] * 2), torch.cat([target[:1]] * 2))
            except Exception:     # a loss tied to its batch's rows (a closure over per-row weights)
                return
            if not (isinstance(one, torch.Tensor) and isinstance(two, torch.Tensor)) \
                    or one.dim() != 0 or two.dim() != 0:
                return
            one_value, two_value = float(one.float()), float(two.float())
        if not (math.isfinite(one_value) and math.isfinite(two_value)) or one_value == 0.0:
            return
        ratio = two_value / one_value
        if abs(ratio - 1.0) <= 1e-2:
            return
        if abs(ratio - 2.0) <= 2e-2:
            raise ValueError("loss_fn declares no reduction and sums over its rows (one row repeated "
                             "twice gives twice its loss), but micro-batch losses are combined as "
                             "means: pass loss_reduction='sum' (or give the loss a .reduction)")
        raise ValueError(f"loss_fn declares no reduction and is neither a mean nor a sum over its rows "
                         f"(one row repeated twice gives {ratio:.3g} times its loss), so splitting a "
                         "mini-batch into micro-batches changes it: pass loss_reduction='mean' or "
                         "'sum' to combine micro-batch losses that way anyway, or return "
                         "(sum, count)")


def refuse_ignored_targets(targets: Any) -> None:
    """ValueError if integer `targets` (a tensor) hold :data:`IGNORED_TARGET` (see
    :class:`UndeclaredReduction`). One read of the device."""
    if isinstance(targets, torch.Tensor) and _real(targets) and not targets.is_floating_point() \
            and targets.dtype != torch.bool and bool((targets == IGNORED_TARGET).any()):
        raise ValueError(
            f"loss_fn declares no reduction and the targets hold {IGNORED_TARGET} (positions "
            "cross-entropy ignores): a function's mean over the targets that count would weigh each "
            "micro-batch by its rows, not by its counted targets, and the step would differ from "
            "full-batch training. Use nn.CrossEntropyLoss(ignore_index=-100) (the engine divides by "
            "the whole mini-batch's count), or return (sum, count), or pass loss_reduction='mean' to "
            "weigh micro-batches by their rows anyway")


def _real(t: torch.Tensor) -> bool:
    """Whether `t` holds values (not a meta or fake tensor of a shape trace)."""
    return t.device.type != "meta" and type(t).__name__ != "FakeTensor"
