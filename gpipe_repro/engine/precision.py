"""Mixed precision: what a cell's forward runs in, and what crosses between stages.

- :data:`PRECISIONS`: "fp32", "bf16", "fp16" and their autocast dtypes;
- :func:`autocast`: the context of a cell's forward (and loss);
- :func:`cast_boundary`: floating boundary values cross as computed, or in the low dtype where asked;
- :func:`upcast`: a low-precision loss is summed (and seeds the backward) in float32.

Parameters and optimizer states stay float32; fp16's dynamic loss scale is
:mod:`gpipe_repro.engine.loss_scaler`'s.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from gpipe_repro.engine import aliasing

__all__ = ["PRECISIONS", "autocast", "cast_boundary", "upcast"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> Any:
    """The context a cell's forward (and loss) runs in: ``torch.autocast`` to the precision's dtype
    on `device`'s type, or nothing for "fp32"."""
    dtype = PRECISIONS[precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def cast_boundary(value: Any, precision: str, low: bool) -> Any:
    """A cell's output as it crosses to the next cell: as computed (the dtypes plain autocast gives
    the next layer: a residual stream autocast keeps in fp32 stays fp32), or with `low` under
    bf16/fp16 every floating value in that dtype (half the bytes sent and kept for the backward; the
    next cell's fp32 ops then see rounded inputs); tensors sharing memory are cast once and stay
    shared (:mod:`gpipe_repro.engine.aliasing`)."""
    dtype = PRECISIONS[precision]
    if dtype is None or not low:
        return value
    return aliasing.map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def upcast(loss: torch.Tensor) -> torch.Tensor:
    """A loss in float16 or bfloat16 as float32 (its sum over micro-batches and its backward seed);
    a float32 or float64 loss as it is (a float64 model trains in float64)."""
    return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss
