"""The in-place input guard: a layer that modifies its input in place must not corrupt what the stage
keeps.

A cell's input is kept for its recompute and backward, and on stage 0 it is the caller's own tensor.
A cell that modifies its input in place (``ReLU(inplace=True)``, ``Dropout(inplace=True)``,
``x.mul_(2)`` as its first layer) would corrupt both, or trip autograd's "leaf Variable ... in-place"
check. So the :class:`InputGuard` learns, once per mode (training / eval) and per guarded layer (0:
the cell), whether the layer modifies its input: the first run feeds it a copy and compares the copy's version
counters before and after. A layer that did is always fed a copy; a layer that did not runs on its
input directly, at no cost, and the version counters are still compared after every run, so a layer
that starts modifying its input later fails the step (before any update) instead of training on
corrupted data. Stage 0's input is the caller's batch, which must never change: stage 0 always
copies it.

:func:`guard_input` is the rule for one value (a copy or a view, and the counters to compare); the
calibration times layers fed the same way (:mod:`gpipe_repro.sim.calibration.timing`, which imports
it under its former name ``feed``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpipe_repro.engine import aliasing, boundary

__all__ = ["InputGuard", "GuardedInput", "guard_input", "fresh_copy", "alias"]


@dataclass
class GuardedInput:
    """A value fed to a layer (`layer` 0: the cell), whether it is a copy (None: a copy, to learn
    whether the layer modifies its input), and the version counters that say whether it did."""
    value: Any
    layer: int
    copy: bool | None
    watched: list[torch.Tensor]
    versions: list[int | None]

    def modified(self) -> bool | None:
        """Whether the layer modified (in place) what it was fed; None where that cannot be known
        (tensors made under ``torch.inference_mode`` keep no version counter)."""
        if any(v is None for v in self.versions):
            return None
        return any(t._version != v for t, v in zip(self.watched, self.versions))


def guard_input(value: Any, copy: bool | None, layer: int = 0) -> GuardedInput:
    """`value` as a layer is fed it: a copy unless `copy` is False (the layer is known not to modify
    its input), then a view (:func:`alias`); with the version counters to check. Tensors of `value`
    sharing memory are copied once and stay shared (:mod:`gpipe_repro.engine.aliasing`): a layer
    writing into one item sees the write in the other, as in plain PyTorch."""
    fed = aliasing.map_tensors(value, alias if copy is False else fresh_copy)
    watched = boundary.tensors(fed)
    return GuardedInput(fed, layer, copy, watched,
                        [None if t.is_inference() else t._version for t in watched])



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


class InputGuard:
    """One stage's in-place rule (see the module docstring): per (mode, layer), whether the layer's
    input is copied, learned on its first run.

    Args:
        stage: the stage's index (stage 0 always copies the cell's input: the caller's batch).
        first_layer, num_layers: where the cell's layers are in the model (for the error message).
    """

    def __init__(self, stage: int, first_layer: int, num_layers: int) -> None:
        self.stage, self.first_layer, self.num_layers = stage, first_layer, num_layers
        self.learned: dict[tuple[bool, int], bool] = {}   # (training, layer) -> copies its input

    def copies(self, training: bool, layer: int = 0) -> bool | None:
        """Whether `layer`'s input is copied in this mode (0: the cell's input); None: not known."""
        if layer == 0 and self.stage == 0:
            # stage 0's input is the caller's batch: a cell that starts modifying it late would
            # already have changed the caller's tensors when caught, so stage 0 always copies
            # (one copy of the input per micro-batch, small next to the cell's activations)
            return True
        return self.learned.get((training, layer))

    def feed(self, value: Any, training: bool, layer: int = 0) -> GuardedInput:
        """What `layer` (0: the cell) is fed for `value`: a copy while it is not known not to modify
        its input in place, else a view."""
        return guard_input(value, self.copies(training, layer), layer)

    def settle(self, fed: GuardedInput, training: bool, microbatch: int) -> None:
        """After `fed` was used: learn whether its layer modifies its input in place (first run), or
        fail the step if one fed without a copy just did."""
        modified = fed.modified()
        if modified is None:        # inference tensors: nothing learned, the layer stays copied
            return
        if fed.copy is None:
            self.learned[(training, fed.layer)] = modified
        elif fed.copy is False and modified:
            self.caught(fed, training, microbatch, None)

    def caught(self, fed: GuardedInput, training: bool, microbatch: int,
               cause: Exception | None) -> None:
        """`fed`'s layer, fed without a copy, modified its input: copy from now on and fail the step
        (`cause`: autograd's in-place error, when that is how it showed)."""
        self.learned[(training, fed.layer)] = True
        last = self.first_layer + self.num_layers - 1
        raise RuntimeError(
            f"stage {self.stage} (layers {self.first_layer}..{last}) modified its input in place on "
            f"micro-batch {microbatch}, which it had not done on its first run, so the kept input is "
            "corrupted; no cell was updated. The engine copies this cell's input from now on: run "
            "the step again") from cause

    def caught_by_autograd(self, fed: GuardedInput, training: bool, microbatch: int,
                           error: RuntimeError) -> None:
        """A layer raised `error`: if it is autograd's in-place check on an uncopied input, that is
        this guard's case (:meth:`caught`); otherwise nothing to do here."""
        if fed.copy is False and any(check in str(error) for check in AUTOGRAD_INPLACE_CHECKS):
            self.caught(fed, training, microbatch, error)


#: How autograd's in-place checks read when a layer modifies the view it was fed: in eager mode, a
#: view of a leaf that requires grad; a compiled layer re-materialized after a no-grad forward
#: (Dynamo raises it wrapped), a view made under no_grad whose base changed with grad enabled.
AUTOGRAD_INPLACE_CHECKS = ("leaf Variable that requires grad",
                           "A view was created in no_grad mode and its base or another view of its "
                           "base has been modified inplace")
