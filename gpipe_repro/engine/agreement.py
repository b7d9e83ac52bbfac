"""What every stage must know the same way to take a step, and what the stages agree on at AGREE.

- :class:`StepConfig`: precision, global clipping, the fp16 loss scale: the same on every stage;
- :class:`Contribution`: what one stage brings to AGREE (its loss and count on the last stage, its
  squared gradient norm and non-finite flag, :func:`stage_contribution`); the transport returns
  their sum over all stages (a sum in one process, one all-reduce of :meth:`Contribution.as_list`
  between processes);
- :class:`Agreement`: derived from that sum, the same on every stage: the reported loss, the global
  gradient norm, the factor every gradient is multiplied by (1/count, 1/loss scale, the clipping
  coefficient) and whether to skip the update (fp16 overflow).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["AGREEMENT_FIELDS", "StepConfig", "Contribution", "Agreement", "stage_contribution"]


@dataclass(frozen=True)
class StepConfig:
    """What every stage must know the same way to take a step.

    Args:
        precision: "fp32", "bf16" or "fp16": autocast dtype of each cell's forward (and loss);
            parameters and optimizer states stay fp32; floating boundary values cross in that dtype.
        clip_grad_norm: the max global L2 norm of all gradients (all cells), or None: no clipping.
        loss_scale: fp16 only: the loss is multiplied by it before backward; gradients are divided.
    """
    precision: str = "fp32"
    clip_grad_norm: float | None = None
    loss_scale: float = 1.0

    @property
    def needs_norm(self) -> bool:
        return self.clip_grad_norm is not None or self.precision == "fp16"


@dataclass(frozen=True)
class Contribution:
    """One stage's numbers at AGREE, or their sum over stages.

    Attributes:
        loss: the last stage's summed (weighted) micro-batch losses; 0 elsewhere.
        count: the summed counts of a ``(sum, count)`` loss; weighted: 1 when the loss has counts.
        grad_sq_norm: the squared L2 norm of the stage's gradients (when clipping or fp16 need it).
        nonfinite: 1 when that norm is not finite.
    """
    loss: float = 0.0
    count: float = 0.0
    weighted: float = 0.0
    grad_sq_norm: float = 0.0
    nonfinite: float = 0.0

    def __add__(self, other: Contribution) -> Contribution:
        return Contribution(*(a + b for a, b in zip(self.as_list(), other.as_list())))

    def as_list(self) -> list[float]:
        """The numbers in :data:`AGREEMENT_FIELDS` order (what an all-reduce carries)."""
        return [getattr(self, name) for name in AGREEMENT_FIELDS]

    @staticmethod
    def from_list(values: Sequence[float]) -> Contribution:
        """The inverse of :meth:`as_list`."""
        return Contribution(*(float(v) for v in values))

    @staticmethod
    def total(parts: Iterable[Contribution]) -> Contribution:
        """The sum of `parts`, added in their order."""
        out = Contribution()
        for part in parts:
            out = out + part
        return out


# The order of the numbers on the wire.
AGREEMENT_FIELDS = tuple(f.name for f in fields(Contribution))


def stage_contribution(loss_sum: torch.Tensor | None, count_sum: torch.Tensor | None,
                       grads: Sequence[torch.Tensor] | None) -> Contribution:
    """A stage's :class:`Contribution`: `loss_sum` and `count_sum` (the last stage's; None elsewhere,
    or no count), and `grads` (None: the step needs no gradient norm)."""
    loss = 0.0 if loss_sum is None else _value(loss_sum)
    count, weighted = (0.0, 0.0) if count_sum is None else (_value(count_sum), 1.0)
    sq_norm = nonfinite = 0.0
    if grads:
        norms = torch._foreach_norm(list(grads))
        sq_norm = _value(torch.stack([n.double() for n in norms]).square().sum())
        nonfinite = float(not math.isfinite(sq_norm))
    return Contribution(loss, count, weighted, sq_norm, nonfinite)


def _value(t: torch.Tensor) -> float:
    """A 0-dim tensor's value; NaN without data (fake or meta tensors: the memory planner's)."""
    if t.device.type == "meta" or is_fake(t):
        return math.nan
    return float(t)


@dataclass(frozen=True)
class Agreement:
    """What all stages agreed on at AGREE (the same on every stage).

    Attributes:
        loss: the mini-batch loss as reported (mean, sum, or sum/count for ``(sum, count)`` losses).
        grad_norm: the global L2 norm of the gradients of the loss, all cells, before clipping
            (None when neither clipping nor fp16 asked for it).
        factor: what every gradient is multiplied by before the update.
        skip: True when a gradient overflowed under fp16: no cell updates, the loss scale drops.
    """
    loss: float
    grad_norm: float | None
    factor: float
    skip: bool

    @staticmethod
    def from_sum(total: Contribution, config: StepConfig) -> Agreement:
        """Derive the agreement from the stages' summed contributions."""
        loss, count, sq_norm = total.loss, total.count, total.grad_sq_norm
        factor = 1.0
        if total.weighted:
            if count <= 0:
                raise ValueError(f"the loss's counts add up to {count:g} over the mini-batch: a "
                                 "(sum, count) loss needs a positive total count (e.g. at least one "
                                 "non-padding token)")
            factor, loss = 1.0 / count, loss / count
        if config.precision == "fp16":
            factor /= config.loss_scale
        norm = None
        if config.needs_norm:
            norm = math.sqrt(sq_norm) * factor if math.isfinite(sq_norm) else math.inf
        skip = config.precision == "fp16" and (total.nonfinite > 0 or not math.isfinite(sq_norm))
        if not skip and config.clip_grad_norm is not None and norm is not None:
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1.
            coef = config.clip_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                factor *= coef
        return Agreement(loss, norm, factor, skip)
