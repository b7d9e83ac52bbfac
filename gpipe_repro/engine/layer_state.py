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
does not. Rotary embeddings whose frequencies follow the batch are watched in every step instead
(:class:`BatchDependentFrequencies`). BatchNorms' buffers are left out (DeferredBatchNorm changes
its statistics at the update; a plain one, ``deferred_batchnorm=False``, per forward by the user's
choice), and so are tensors without values (the memory planner's traces).
"""
from __future__ import annotations

import torch
from torch import nn

from gpipe_repro.engine.traced import has_values

__all__ = ["BatchDependentFrequencies", "BufferWatch", "batch_dependent_rope"]

Snapshot = dict[str, torch.Tensor]


def put_back(cell: nn.Module, snapshot: Snapshot | None) -> None:
    """`cell`'s buffers as `snapshot` holds them (by name; in place where shape and dtype match)."""
    for name, value in (snapshot or {}).items():
        owner, _, leaf = name.rpartition(".")
        module = cell.get_submodule(owner)
        current = module._buffers.get(leaf)
        if current is not None and current.shape == value.shape and current.dtype == value.dtype:
            with torch.no_grad():
                current.copy_(value)
        else:
            module._buffers[leaf] = value


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
        put_back(self.cell, self.origin)
        self.origin = None

    def _buffers(self) -> Snapshot:
        norms = {id(b) for mod in self.cell.modules()     # rotary ones: BatchDependentFrequencies
                 if isinstance(mod, nn.modules.batchnorm._BatchNorm) or batch_dependent_rope(mod)
                 for b in mod.buffers(recurse=False)}
        return {name: b for name, b in self.cell.named_buffers() if id(b) not in norms and has_values(b)}

    def _snapshot(self) -> Snapshot:
        return {name: b.detach().clone() for name, b in self._buffers().items()}


#: transformers' rotary types whose frequencies follow the largest position of the batch a forward is
#: given (``dynamic_rope_update``): "dynamic" NTK scaling (and its variants) and "longrope".
def batch_dependent_rope(module: nn.Module) -> str | None:
    """The rope type of `module` where it is a rotary embedding whose frequencies depend on its
    batch's positions, else None."""
    rope = getattr(module, "rope_type", None)
    kinds = rope.values() if isinstance(rope, dict) else [rope]
    found = [k for k in kinds if isinstance(k, str) and ("dynamic" in k or k == "longrope")]
    return found[0] if found else None


class BatchDependentFrequencies:
    """Rotary embeddings whose frequencies follow the largest position in the batch they are given
    (transformers' "dynamic" and "longrope" types: Phi-3's long-context models, dynamic NTK), watched
    in every step, training and inference alike: full-batch training chooses them once from the whole
    batch, a pipeline from each micro-batch. Where every micro-batch of a step leaves them as the
    first did, each used what the whole batch gives; where one changes them (rows padded or packed so
    that micro-batches end at other positions), the step is refused, its buffers put back (a
    longrope Phi-3 trained weights 8.5e-4 off with left-padded position ids, silently, and its
    pipelined logits were 2.7e-3 off). Each check compares a few hundred numbers and reads the
    device once per micro-batch, for these models only. Replicas compare within their process only."""

    def __init__(self, cell: nn.Sequential, first_layer: int) -> None:
        self.cell, self.first_layer = cell, first_layer
        self.watched = [(name, mod, rope) for name, mod in cell.named_modules()
                        if (rope := batch_dependent_rope(mod)) is not None]
        self.first: Snapshot | None = None
        self.origin: Snapshot | None = None

    def begin(self) -> None:
        """A mini-batch begins (a training step or a pipelined inference)."""
        self.first = None
        self.origin = self._snapshot() if self.watched else None

    def after_forward(self, microbatch: int, microbatches: int) -> None:
        """After a micro-batch's forward: raise ValueError where the frequencies differ from those
        the step's first forward left."""
        if not self.watched or microbatches < 2:
            return
        now = self._snapshot()
        if self.first is None:
            self.first = now
            return
        changed = [k for k, v in now.items() if k not in self.first or self.first[k].shape != v.shape
                   or not torch.equal(self.first[k], v)]
        if not changed:
            return
        name = changed[0].rpartition(".")[0]
        rope = next(r for n, _, r in self.watched if n == name)
        index = int(name.split(".", 1)[0])
        self._restore()
        raise ValueError(
            f"layer {self.first_layer + index} ({type(self.cell[index]).__name__}) holds a rotary "
            f"embedding of rope_type {rope!r} ({name}), whose frequencies follow the largest position "
            f"of the batch it is given; micro-batch {microbatch} gave other frequencies than the "
            "step's first, where full-batch training takes them once from the whole batch. Use "
            f"micro_batches=1, or position ids whose largest value is alike in every micro-batch "
            "(rows of one length, unpadded), or a rope type whose frequencies are fixed")

    def _snapshot(self) -> Snapshot:
        return {f"{name}.{b}" if name else b: t.detach().clone() for name, mod, _ in self.watched
                for b, t in mod.named_buffers(recurse=False) if has_values(t)}

    def _restore(self) -> None:
        put_back(self.cell, self.origin)
        self.origin = None
