"""Layers whose forward changes their own state (a buffer): full-batch training runs each layer's
forward once per step, a pipeline once per micro-batch and again per recompute, so such a layer would
compute something else. :class:`BufferWatch` refuses it on the first forwards and recompute of a
stage that show it; the known such layers (an InstanceNorm with running statistics, spectral
normalization) are refused at construction
(:func:`~gpipe_repro.engine.arguments.check_running_statistics`).

What counts is a buffer the second micro-batch's forward changes again (a counter, a running average,
a power iteration), or one a recompute changes (a layer skips its side effects there by asking
:func:`~gpipe_repro.engine.recompute.is_recomputing`). A value the forward sets alike each time, from
the input's shape as rotary embeddings set theirs, is not: the first forward changes it, the second
does not. BatchNorms' buffers are left out (DeferredBatchNorm changes its statistics at the update; a
plain one, ``deferred_batchnorm=False``, per forward by the user's choice), and so are tensors without
values (the memory planner's traces).
"""
from __future__ import annotations

import torch
from torch import nn

from gpipe_repro.engine.traced import has_values

__all__ = ["BufferWatch"]

Snapshot = dict[str, torch.Tensor]


class BufferWatch:
    """The checks of one stage's cell (see the module docstring).

    Args:
        cell: the stage's layers; first_layer: the index of its first layer in the whole model.
    """

    def __init__(self, cell: nn.Sequential, first_layer: int) -> None:
        self.cell, self.first_layer = cell, first_layer
        self.forwards_checked, self.changed_by_forward, self.recompute_checked = 0, False, False
        self.origin: Snapshot | None = None      # the buffers as a step that checks began

    def begin_step(self, microbatches: int, recomputes: bool) -> None:
        """A training step begins: where it will check a forward or a recompute, keep the buffers as
        they are, so that a refusal puts them back (it comes after the forwards that showed it, and
        a refused step changes nothing)."""
        checks = ((microbatches > 1 and self.forwards_checked < 2)
                  or (recomputes and not self.recompute_checked))
        self.origin = self._snapshot() if checks else None

    def before_forward(self, microbatches: int) -> Snapshot | None:
        """A training forward is about to run: the buffers to compare after it, where it is checked
        (the first two forwards with M > 1 micro-batches)."""
        return self._snapshot() if microbatches > 1 and self.forwards_checked < 2 else None

    def before_recompute(self) -> Snapshot | None:
        """A recompute is about to run: the buffers to compare after it (the first one only)."""
        return None if self.recompute_checked else self._snapshot()

    def after(self, before: Snapshot, action: str, microbatches: int) -> None:
        """After the forward (``action="forward"``) or recompute `before` was taken for: raise
        ValueError, saying what to change, where it changed a buffer as the module docstring says."""
        now = self._buffers()
        changed = [name for name, old in before.items() if name not in now or now[name].shape != old.shape
                   or not torch.equal(now[name], old)]
        if action == "recompute":
            self.recompute_checked = True
        else:
            self.forwards_checked += 1
            if self.forwards_checked == 1:
                self.changed_by_forward = bool(changed)
                return
            if not self.changed_by_forward:
                changed = []
        if not changed:
            return
        self._restore()
        index, buffer = changed[0].split(".", 1)
        where = f"layer {self.first_layer + int(index)} ({type(self.cell[int(index)]).__name__})"
        if action == "recompute":
            raise ValueError(f"{where} changed its buffer {buffer!r} when its forward was recomputed "
                             "(re-materialization), which full-batch training does not run: skip the "
                             "change where gpipe_repro.is_recomputing() is true, or use "
                             "checkpoint='never'")
        raise ValueError(
            f"{where} changes its buffer {buffer!r} in every forward: with micro_batches={microbatches} "
            "the pipeline runs that forward once per micro-batch, full-batch training once per step. "
            "Update the buffer once per step (outside the forward), or use micro_batches=1")

    def _restore(self) -> None:
        """The buffers as the step began (:meth:`begin_step`), before a refusal."""
        if self.origin is None:
            return
        for name, value in self.origin.items():
            owner, _, leaf = name.rpartition(".")
            module = self.cell.get_submodule(owner)
            current = module._buffers.get(leaf)
            if current is not None and current.shape == value.shape and current.dtype == value.dtype:
                with torch.no_grad():
                    current.copy_(value)
            else:
                module._buffers[leaf] = value
        self.origin = None

    def _buffers(self) -> Snapshot:
        norms = {id(b) for mod in self.cell.modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)
                 for b in mod.buffers(recurse=False)}
        return {name: b for name, b in self.cell.named_buffers() if id(b) not in norms and has_values(b)}

    def _snapshot(self) -> Snapshot:
        return {name: b.detach().clone() for name, b in self._buffers().items()}
