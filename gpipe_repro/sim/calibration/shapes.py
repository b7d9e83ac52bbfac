"""Shapes on ``meta``: each layer's input and output, groups of identical layers, real copies to time."""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine import boundary
from gpipe_repro.models.signature import layer_signature


def trace_shapes(layers: Sequence[nn.Module], sample: Any) -> tuple[list[Any], list[Any], list[int]]:
    """Each layer's (meta) input and output, and its group of identical layers.

    `layers` may live on any device; they are copied to ``meta`` one at a time, so tracing a model of
    any size costs no memory and almost no time.
    """
    inputs, outputs, groups, _ = trace_signatures(layers, sample)
    return inputs, outputs, groups


def trace_signatures(layers: Sequence[nn.Module],
                     sample: Any) -> tuple[list[Any], list[Any], list[int], list[str]]:
    """:func:`trace_shapes` and each layer's :func:`layer_signature` (what its group is made of)."""
    x = boundary.map_tensors(sample, lambda t: t.to("meta"))
    inputs: list[Any] = []
    outputs: list[Any] = []
    groups: list[int] = []
    signatures: list[str] = []
    seen: dict[str, int] = {}
    with torch.no_grad():
        for layer in layers:
            meta = copy.deepcopy(layer).to("meta").train()
            y = meta(x)
            sig = layer_signature(meta, x, y)
            groups.append(seen.setdefault(sig, len(seen)))
            signatures.append(sig)
            inputs.append(x)
            outputs.append(y)
            x = y
    return inputs, outputs, groups, signatures


def materialize(layer: nn.Module, device: torch.device | str) -> nn.Module:
    """A copy of `layer` with real, freshly initialized storage on `device` (works from ``meta``)."""
    real = copy.deepcopy(layer).to_empty(device=device)
    with torch.no_grad():
        for p in real.parameters():
            p.normal_(0.0, 0.02)
        for b in real.buffers():
            b.zero_()
        for m in real.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
    return real


def materialize_value(value: Any, device: torch.device | str, seed: int = 0) -> Any:
    """Real tensors shaped like a meta value: floats random normal, integers 0, bools True."""
    g = torch.Generator().manual_seed(seed)

    def make(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:
            return torch.randn(t.shape, generator=g, dtype=t.dtype).to(device)
        if t.dtype == torch.bool:
            return torch.ones(t.shape, dtype=torch.bool, device=device)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)

    return boundary.map_tensors(value, make)


