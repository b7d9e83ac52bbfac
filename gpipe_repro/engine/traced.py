"""Tensors without values: the meta and fake tensors of shape traces (the memory planner runs the
engine on them). A check that reads values skips them."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["has_values"]


def has_values(t: torch.Tensor) -> bool:
    """Whether `t` holds values (not a meta or fake tensor of a shape trace)."""
    return not (t.device.type == "meta" or is_fake(t))
