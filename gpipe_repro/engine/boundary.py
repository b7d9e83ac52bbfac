"""What may cross a cell boundary, and how it crosses.

A boundary value is a tensor, or a tuple (nested tuples allowed) of tensors and plain values (None,
bool, int, float, str). Floating (and complex) tensors carry a gradient back across a cell boundary;
integer and bool tensors (token ids, masks) and plain values travel forward only. This is the rule
of `torch.utils.checkpoint`, and for the same reason: a checkpointed forward runs under `no_grad`,
where nothing requires grad, so "does this output require grad" cannot be known until the recompute.
The producer drops a gradient that arrives for an output it did not differentiate (a float mask,
say), so the rule costs at most a little wasted work, never a wrong gradient. Dicts and arbitrary
objects are refused with an error naming the fix, because the distributed runtime must be able to
describe every value by shape and dtype (tensors) or by value (plain leaves).

Tensors of one value that share memory (``(h, h)``, ``(h, h[0])``) stay shared across a boundary
(:mod:`gpipe_repro.engine.aliasing`): :func:`detach`, :func:`attach` and :func:`to_device` make one
new tensor per shared memory and rebuild the others from it. Its gradient is then one gradient, the
sum of what flowed through every item: :func:`input_grads` gives one per shared memory, and
:func:`grad_pairs` seeds the producer's backward once per shared memory too.
"""
from __future__ import annotations

from typing import Any

import torch

from gpipe_repro.engine import aliasing, microbatch

__all__ = ["PLAIN", "check", "tensors", "map_tensors", "carries_grad", "detach", "attach", "cut", "to_device",
           "grad_pairs", "input_grads"]

PLAIN = (type(None), bool, int, float, str)
# What a boundary value is called where its tensors share memory in a way that cannot be rebuilt:
# refused where it leaves a layer for a cut (detach, cut), left unshared elsewhere.
SENT = "a value crossing a cut between layers"


def check(value: Any, where: str) -> None:
    """Raise a TypeError naming `where` unless `value` is a supported boundary value."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, tuple):
        for item in value:
            _check_leaf(item, where)
        return
    raise TypeError(f"{where} produced a {type(value).__name__}; a value crossing layers must be a "
                    "tensor or a tuple of tensors and plain values (None/bool/int/float/str). "
                    "Return a tuple instead.")


def _check_leaf(item: Any, where: str) -> None:
    if isinstance(item, (torch.Tensor, *PLAIN)):
        return
    if isinstance(item, tuple):
        for sub in item:
            _check_leaf(sub, where)
        return
    raise TypeError(f"{where} produced a tuple holding a {type(item).__name__}; tuple items must be "
                    "tensors, nested tuples or plain values (None/bool/int/float/str). Convert it "
                    "(a list to a tuple, a dict to a tuple of its values).")


def tensors(value: Any) -> list[torch.Tensor]:
    """Tensor leaves of `value` in a fixed depth-first order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    return []


def map_tensors(value: Any, fn: Any) -> Any:
    """Apply `fn` to every tensor leaf, keeping the structure."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return microbatch.rebuild(value, [map_tensors(v, fn) for v in value])
    return value


def carries_grad(t: torch.Tensor) -> bool:
    """Whether a tensor crossing a cell boundary carries a gradient back (see the module docstring):
    a floating or complex one (``torch.fft`` outputs, say)."""
    return t.is_floating_point() or t.is_complex()


def detach(value: Any) -> Any:
    """Cut the autograd graph at the boundary; the receiver re-attaches with :func:`attach`. Tensors
    sharing memory in a way the receiver cannot rebuild are refused (:class:`AliasingError
    <gpipe_repro.engine.aliasing.AliasingError>`)."""
    return aliasing.map_tensors(value, lambda t: t.detach(), SENT)


def attach(value: Any, device: torch.device) -> Any:
    """Move to `device` as new autograd leaves, one per shared memory (tensors aliasing it are
    rebuilt from it); floating tensors will collect a gradient."""
    return aliasing.map_tensors(value, lambda t: t.detach().to(device, non_blocking=True)
                                .requires_grad_(carries_grad(t)))


def cut(value: Any) -> Any:
    """A graph cut inside a cell: `value` as new autograd leaves, one per shared memory (same
    storage, no copy); a tensor no gradient flows through stays without one."""
    return aliasing.map_tensors(value, lambda t: t.detach().requires_grad_(t.requires_grad
                                                                           and carries_grad(t)), SENT)


def to_device(value: Any, device: torch.device) -> Any:
    """Move a mini-batch input or target to `device` (no gradient), keeping shared memory shared."""
    return aliasing.map_tensors(value, lambda t: t.to(device, non_blocking=True))


def _carriers(value: Any) -> list[torch.Tensor]:
    """The tensors of `value` that travel: one per shared memory (:mod:`~gpipe_repro.engine.aliasing`)."""
    leaves = tensors(value)
    return aliasing.travelling(leaves, aliasing.layout(leaves, None))


def grad_pairs(outputs: Any,
               grads: list[torch.Tensor | None]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(output tensors, incoming gradients) for outputs that carry one and were differentiated: one
    per shared memory, whose gradient is already the sum over the items sharing it."""
    leaves = tensors(outputs)
    lay = aliasing.layout(leaves, SENT)
    for j, (t, a) in enumerate(zip(leaves, lay)):
        if a is not None and carries_grad(t):
            _check_same_graph(leaves[a.carrier], t, a.carrier, j)
    outs = [t for t in aliasing.travelling(leaves, lay) if carries_grad(t)]
    if len(outs) != len(grads):
        raise RuntimeError(f"{len(grads)} gradients arrived for {len(outs)} floating outputs")
    keep = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    return [o for o, _ in keep], [g for _, g in keep]


def _check_same_graph(carrier: torch.Tensor, t: torch.Tensor, i: int, j: int) -> None:
    """Items sharing memory receive one gradient, seeded into the carrier's graph: exact only when
    every item's gradient flows into that graph (the same tensor, or views of one tensor)."""
    def root(x: torch.Tensor) -> torch.Tensor:
        return x if x._base is None else x._base
    if carrier.requires_grad == t.requires_grad and (not t.requires_grad or root(carrier) is root(t)):
        return
    raise aliasing.AliasingError(
        f"tensors #{i} and #{j} of {SENT} share memory but not their "
        "autograd graph (one is detached, or made requires_grad on its own), so the one gradient "
        "they receive cannot be split between them. Return the tensor once, or a copy "
        "(.detach().clone() or .clone()) for the second item")


def input_grads(inputs: Any) -> list[torch.Tensor | None]:
    """Gradients of the floating inputs after backward (None where nothing flowed): one per shared
    memory, the sum over the items sharing it."""
    return [t.grad for t in _carriers(inputs) if carries_grad(t)]
