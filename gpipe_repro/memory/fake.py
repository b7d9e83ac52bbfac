"""Fake copies of layers and batches: the right shapes and dtypes, no memory.

The planner measures memory by *running* code under ``FakeTensorMode``: every op computes its
output's shape, dtype and size through the real kernels' meta functions, and nothing is allocated.
Layers given on the meta device (how big models are built: ``with torch.device("meta")``) or on a
real device are copied here with fake parameters and buffers of the same shapes (parameters shared
between layers stay shared); batches become fake tensors of the same shapes.

We do not run on the meta device itself: it is not the CPU/GPU code path. For attention it takes the
"math" fallback of ``scaled_dot_product_attention`` (materializing the N x heads x T x T matrix),
whereas fake CPU tensors dispatch to the fused kernel PyTorch really runs (see
:mod:`gpipe_repro.memory.profile`).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from gpipe_repro.engine import boundary


def is_fake(t: Any) -> bool:
    return isinstance(t, FakeTensor)


def fake_tensor_like(t: torch.Tensor, mode: FakeTensorMode, device: str = "cpu") -> torch.Tensor:
    """A fake tensor with `t`'s shape, dtype and requires_grad (values undefined)."""
    with mode:
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


def fake_value(value: Any, mode: FakeTensorMode, device: str = "cpu") -> Any:
    """A batch (tensor or nested tuple) with every tensor replaced by a fake one."""
    return boundary.map_tensors(value, lambda t: fake_tensor_like(t, mode, device))


def fake_module(module: nn.Module, mode: FakeTensorMode, device: str = "cpu",
                memo: dict[int, torch.Tensor] | None = None) -> nn.Module:
    """A copy of `module` whose parameters and buffers are fake tensors on `device`.

    `memo` (id of an original tensor -> its fake) keeps weights shared across layers shared."""
    memo = {} if memo is None else memo
    originals = {id(m): m for m in module.modules()}
    # Copy the module tree without copying tensor data: parameters and buffers are swapped after.
    tensor_memo: dict[int, Any] = {}
    for m in originals.values():
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                tensor_memo[id(t)] = t          # deepcopy keeps the same object (no data copy)
    clone = copy.deepcopy(module, memo=tensor_memo)
    for m in clone.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(fake_tensor_like(p, mode, device), requires_grad=p.requires_grad)
            fake = memo[id(p)]
            assert isinstance(fake, nn.Parameter), "a parameter's fake is a Parameter (memo keys are ids)"
            m._parameters[name] = fake
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            if id(b) not in memo:
                memo[id(b)] = fake_tensor_like(b, mode, device)
            m._buffers[name] = memo[id(b)]
    return clone


def fake_layers(layers: list[nn.Module], mode: FakeTensorMode, device: str = "cpu") -> list[nn.Module]:
    """Fake copies of a layer sequence, sharing what the originals share."""
    memo: dict[int, torch.Tensor] = {}
    return [fake_module(layer, mode, device, memo) for layer in layers]
