"""Signatures: when are two layers, or two boundary values, the same (for memory and for time)?

The one signature module: the memory planner and the simulator's calibration both ask it.

Identical cells are traced once. A Transformer-L is an embedding, L equal layers and a head; an
AmoebaNet stack repeats one cell. The planner profiles each distinct (layer, input) pair once and
composes the profiles, so a 1663-layer model costs four profiles, not 1663.

- :func:`layer_key`: a layer's class, ``repr`` (which spells out every sub-module and its sizes) and
  the shapes/dtypes of its parameters and buffers. Two layers with equal keys are assumed to run the
  same ops on the same input (true for every model here; a layer whose forward depends on state its
  repr does not show would need its own ``extra_repr``).
- :class:`ValueSig`: a boundary value's structure, the shape/dtype/requires_grad of each tensor leaf,
  and which leaves share a storage (a layer may pass its input through, as AmoebaNet's cells do).
- :func:`compress`: a layer sequence as runs of consecutive equal layers.
- :func:`layer_signature`: a layer with the signatures of its input and output, as the calibration
  groups layers: two layers with equal signatures cost the same time, so one is timed for all.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind a tensor, or None for tensors without one (sparse, nested, ...)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


@dataclass(frozen=True)
class TensorSig:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    group: int              # leaves with the same group share one storage

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class ValueSig:
    """What crosses a layer boundary, as data (hashable)."""

    spec: Any                               # pytree spec; tensor leaves are TensorSig, others plain
    leaves: tuple[Any, ...]
    group_bytes: tuple[int, ...]            # storage bytes of each group

    @property
    def tensors(self) -> list[TensorSig]:
        return [leaf for leaf in self.leaves if isinstance(leaf, TensorSig)]

    @property
    def nbytes(self) -> int:
        return sum(self.group_bytes)

    def grad_bytes(self) -> int:
        """Bytes of the gradients that flow back through this value (floating leaves)."""
        return sum(t.nbytes for t in self.tensors if t.dtype.is_floating_point)

    def with_requires_grad(self, requires_grad: bool | None) -> ValueSig:
        """The same value as received at a cell boundary (floats require grad) or with no grad."""
        leaves = tuple(
            TensorSig(leaf.shape, leaf.dtype,
                      leaf.dtype.is_floating_point if requires_grad is None else
                      (requires_grad and leaf.dtype.is_floating_point), leaf.group)
            if isinstance(leaf, TensorSig) else leaf for leaf in self.leaves)
        return ValueSig(self.spec, leaves, self.group_bytes)

    def describe(self) -> str:
        parts = [f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}" for t in self.tensors]
        return "(" + ", ".join(parts) + ")"


def value_sig(value: Any) -> ValueSig:
    """The signature of a concrete (real, fake or meta) value."""
    leaves, spec = pytree.tree_flatten(value)
    groups: dict[int, int] = {}
    group_bytes: list[int] = []
    out: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            st = storage_of(leaf)
            key = id(st) if st is not None and leaf.device.type != "meta" else id(leaf)
            if key not in groups:
                groups[key] = len(group_bytes)
                group_bytes.append(st.nbytes() if st is not None and leaf.device.type != "meta"
                                   else leaf.numel() * leaf.element_size())
            out.append(TensorSig(tuple(leaf.shape), leaf.dtype, bool(leaf.requires_grad), groups[key]))
        else:
            out.append(leaf)
    return ValueSig(spec, tuple(out), tuple(group_bytes))


def make_value(sig: ValueSig, make: Any) -> Any:
    """Build a value from its signature; `make(TensorSig) -> Tensor` makes one tensor per group."""
    made: dict[int, torch.Tensor] = {}
    leaves = []
    for leaf in sig.leaves:
        if isinstance(leaf, TensorSig):
            if leaf.group not in made:
                made[leaf.group] = make(leaf)
            leaves.append(made[leaf.group])
        else:
            leaves.append(leaf)
    return pytree.tree_unflatten(leaves, sig.spec)


def microbatch_sig(value: Any, size: int) -> ValueSig:
    """The signature of the first `size` examples of a batch (dim 0 of every batched tensor)."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        return torch.empty((size, *t.shape[1:]), dtype=t.dtype, device="meta")
    leaves, spec = pytree.tree_flatten(value)
    return value_sig(pytree.tree_unflatten([cut(x) if isinstance(x, torch.Tensor) else x
                                            for x in leaves], spec))


def layer_key(layer: nn.Module) -> tuple[Any, ...]:
    """Equal keys = same computation and memory (see the module docstring)."""
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    return (type(layer).__qualname__, type(layer).__module__, repr(layer), params, buffers,
            layer.training)


def layer_signature(layer: nn.Module, x: Any, y: Any) -> str:
    """A layer's :func:`layer_key` with the signatures of its input `x` and output `y`: layers with
    equal signatures run the same ops on the same shapes, so they cost the same time."""
    return repr((layer_key(layer), value_sig(x), value_sig(y)))


@dataclass(frozen=True)
class LayerRun:
    """`count` consecutive copies of one layer (a representative module)."""

    layer: nn.Module
    count: int


def compress(layers: Sequence[nn.Module]) -> list[LayerRun]:
    """Runs of consecutive layers with equal :func:`layer_key`."""
    runs: list[LayerRun] = []
    last_key: tuple[Any, ...] | None = None
    for layer in layers:
        key = layer_key(layer)
        if runs and key == last_key:
            runs[-1] = LayerRun(runs[-1].layer, runs[-1].count + 1)
        else:
            runs.append(LayerRun(layer, 1))
            last_key = key
    return runs
