"""The zero-bubble split of a backward (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
its input half now, its weight half later, as the stage executor's BACKWARD_INPUT and
BACKWARD_WEIGHT run it (:meth:`gpipe_repro.engine.stage.StageExecutor._backward_input`), and as the
calibration times it (:mod:`gpipe_repro.sim.calibration.timing`)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["split_backward_input", "full_backward", "backward_now", "reached_params"]


def split_backward_input(outs: list[torch.Tensor], grads: list[torch.Tensor], leaves: list[torch.Tensor],
                          params: Sequence[torch.Tensor]) -> Callable[[], None]:
    """Compute the input gradients of ``outs`` (seeded with ``grads``) into ``leaves[i].grad`` now;
    return the function that later computes the parameters' gradients into ``p.grad``.

    Uses PyTorch pipelining's graph analysis (torch.distributed.pipelining._backward, the code behind
    its zero-bubble schedules): the parameters are grouped by the nodes where their gradient paths
    meet the input's path; pre-hooks on those nodes keep the gradients arriving there during the input
    pass, and the weight pass starts from them. A parameter whose path never meets the input's (the
    analysis cannot split it) makes us fall back to one full backward now and nothing later, which is
    correct, only not split."""
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc,
        construct_reverse_graph,
        get_param_groups,
        stage_backward_weight,
    )
    leaves = _distinct_leaves(leaves)
    out_fns = [f for f in map(_get_grad_fn_or_grad_acc, outs) if f is not None]
    in_fns = [f for f in map(_get_grad_fn_or_grad_acc, leaves) if f is not None]
    param_fns = [f for f in map(_get_grad_fn_or_grad_acc, params) if f is not None]
    reverse = construct_reverse_graph(out_fns)
    reachable = {f for f in param_fns if f in reverse}   # (before get_param_groups adds keys to it)
    groups = get_param_groups(in_fns, param_fns, reverse)
    grouped = set().union(*(g["params"] for g in groups)) if groups else set()
    if not reachable <= grouped:
        torch.autograd.backward(outs, grads)
        return lambda: None
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):
            def keep(grad_inputs: Any, group: dict[str, Any] = group, i: int = i) -> None:
                group["grads"][i] = grad_inputs
            handles.append(node.register_prehook(keep))
    try:
        dx = torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for leaf, g in zip(leaves, dx):
        if g is not None:
            leaf.grad = g if leaf.grad is None else leaf.grad + g
    if any(x is None for g in groups for x in g["grads"]):
        # A join node no gradient reached: walk the retained graph again for the parameters only.
        used = [p for p, f in zip(params, param_fns) if f in reachable]

        def weights_again() -> None:
            torch.autograd.backward(outs, grads, inputs=used)
        return weights_again

    def weights() -> None:
        stage_backward_weight(iter(params), groups)  # type: ignore[arg-type]  # any leaf works
    return weights


def _distinct_leaves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The autograd leaves behind `tensors`, once each: a cut's input holding one tensor twice, or a
    view of it (:mod:`gpipe_repro.engine.aliasing`), collects one gradient, the sum, in one leaf."""
    found: dict[int, torch.Tensor] = {}
    for t in tensors:
        leaf = t._base if t._base is not None and t._base.is_leaf else t
        found.setdefault(id(leaf), leaf)
    return list(found.values())


def full_backward(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[], None]:
    """The whole backward of `outs`, to run later (BACKWARD_WEIGHT of a cell with no input
    gradient)."""
    def run() -> None:
        torch.autograd.backward(outs, grads)
    return run


def backward_now(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[], None]:
    """The whole backward of `outs` now (input and weight gradients at once), and nothing later: the
    split's fallback where the graph reaches a leaf outside the cell (see :func:`reached_params`)."""
    torch.autograd.backward(outs, grads)
    return lambda: None


def reached_params(outs: list[torch.Tensor], order: Mapping[int, int],
                   exclude: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The leaves requiring grad that the graph of `outs` reaches, other than `exclude` (the cut's
    own leaves, whose gradient is the input half's): first the cell's parameters (those whose ``id``
    is in `order`, their positions) in that order, a layer's own and any it uses without registering
    them (a head holding a reference to another layer's weight); then any other leaf in the order
    the walk meets it: another cell's parameter that a loss or a layer reads (a regularizer over
    the whole model), a tensor a layer captured. Plain training's backward reaches all of them, so
    a split must too: the stage executor runs such a layer's backward whole, at once
    (:func:`backward_now`), since PyTorch's graph analysis may group a leaf outside the cell with
    nodes another group's weight pass has already freed."""
    skip = {id(t) for t in exclude or []}
    found: dict[int, torch.Tensor] = {}
    others: dict[int, torch.Tensor] = {}
    seen: set[Any] = set()
    todo = [t.grad_fn for t in outs]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)     # an AccumulateGrad node's leaf
        if variable is not None and id(variable) not in skip:
            (found if id(variable) in order else others).setdefault(id(variable), variable)
        todo.extend(f for f, _ in node.next_functions)
    return sorted(found.values(), key=lambda p: order[id(p)]) + list(others.values())
