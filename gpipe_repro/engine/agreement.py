"""What every stage must know the same way to take a step, and what the stages agree on at AGREE.

- :class:`StepConfig`: precision, global clipping, the fp16 loss scale: the same on every stage;
- :data:`AGREEMENT_FIELDS`: the small vector each stage contributes at AGREE (its loss and count on
  the last stage, its squared gradient norm and non-finite flag); the transport returns its sum over
  all stages (a sum in one process, one all-reduce between processes);
- :class:`Agreement`: derived from that sum, the same on every stage: the reported loss, the global
  gradient norm, the factor every gradient is multiplied by (1/count, 1/loss scale, the clipping
  coefficient) and whether to skip the update (fp16 overflow);
- precision handling: :data:`PRECISIONS`, :func:`autocast` (a cell's forward),
  :func:`cast_boundary` (floating boundary values cross in the low dtype) and :func:`upcast` (a
  low-precision loss is summed in float32).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpipe_repro.engine import aliasing

__all__ = ["PRECISIONS", "AGREEMENT_FIELDS", "StepConfig", "Agreement", "autocast", "cast_boundary",
           "upcast"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# The vector each stage contributes at AGREE; the transport returns its sum over stages.
AGREEMENT_FIELDS = ("loss", "count", "weighted", "grad_sq_norm", "nonfinite")


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
    def from_sum(total: Sequence[float], config: StepConfig) -> Agreement:
        """Derive the agreement from the summed :data:`AGREEMENT_FIELDS` vector."""
        loss, count, weighted, sq_norm, nonfinite = (float(v) for v in total)
        factor = 1.0
        if weighted:
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
        skip = config.precision == "fp16" and (nonfinite > 0 or not math.isfinite(sq_norm))
        if not skip and config.clip_grad_norm is not None and norm is not None:
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1.
            coef = config.clip_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                factor *= coef
        return Agreement(loss, norm, factor, skip)


def autocast(precision: str, device: torch.device) -> Any:
    """The context a cell's forward (and loss) runs in: ``torch.autocast`` to the precision's dtype
    on `device`'s type, or nothing for "fp32"."""
    dtype = PRECISIONS[precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def cast_boundary(value: Any, precision: str) -> Any:
    """Under bf16/fp16, floating boundary values cross in that dtype (half the bytes); tensors
    sharing memory are cast once and stay shared (:mod:`gpipe_repro.engine.aliasing`)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return value
    return aliasing.map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def upcast(loss: torch.Tensor) -> torch.Tensor:
    """A loss in float16 or bfloat16 as float32 (its sum over micro-batches and its backward seed);
    a float32 or float64 loss as it is (a float64 model trains in float64)."""
    return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss
