"""Feeding a layer its input under the in-place rule: a copy while the layer is not known to leave
its input alone, else a view; and the version counters that tell whether it modified what it was
fed. The stage executor learns the rule per cell and per zero-bubble cut
(:mod:`gpipe_repro.engine.stage`, "In-place layers"); the calibration times layers fed the same way
(:mod:`gpipe_repro.sim.calibration.timing`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpipe_repro.engine import aliasing, boundary

__all__ = ["Feed", "feed", "fresh_copy", "alias"]


@dataclass
class Feed:
    """A value fed to a layer (`layer` 0: the cell), whether it is a copy (None: a copy, to learn
    whether the layer modifies its input), and the version counters that say whether it did."""
    value: Any
    layer: int
    copy: bool | None
    watched: list[torch.Tensor]
    versions: list[int]

    def modified(self) -> bool:
        """Whether the layer modified (in place) what it was fed."""
        return any(t._version != v for t, v in zip(self.watched, self.versions))


def feed(value: Any, copy: bool | None, layer: int = 0) -> Feed:
    """`value` as a layer is fed it: a copy unless `copy` is False (the layer is known not to modify
    its input), then a view (:func:`alias`); with the version counters to check. Tensors of `value`
    sharing memory are copied once and stay shared (:mod:`gpipe_repro.engine.aliasing`): a layer
    writing into one item sees the write in the other, as in plain PyTorch."""
    fed = aliasing.map_tensors(value, alias if copy is False else fresh_copy)
    watched = boundary.tensors(fed)
    return Feed(fed, layer, copy, watched, [t._version for t in watched])


def fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy a layer may modify in place; gradients flow through it to `t`."""
    return t.clone()


def alias(t: torch.Tensor) -> torch.Tensor:
    """What a layer is fed in place of a boundary leaf it does not modify: a view (no copy), so that
    it is not itself a leaf that requires grad. Autocast caches the low-precision cast of such leaves
    as it does a weight's, so a boundary value read by two low-precision ops would be cast once and
    the two gradients summed in bf16/fp16, where plain training (whose activations are not leaves)
    sums them in fp32."""
    return t.view_as(t) if t.is_leaf and t.requires_grad else t
