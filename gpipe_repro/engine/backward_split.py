"""The zero-bubble split of a backward (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
its input half now, its weight half later, as the stage executor's BACKWARD_INPUT and
BACKWARD_WEIGHT run it, and as the calibration times it (:mod:`gpipe_repro.sim.calibration.timing`).

The split runs one layer at a time, last to first, on a graph cut at every layer boundary while the
forward ran (:class:`LayerCuts`): each layer's input gradient seeds the previous layer's split
(:func:`split_by_layer`). Why: the weight half makes one autograd call per group of parameters, and
each call walks the whole graph below its starting nodes, so on one graph of the cell the weight
half grows with the square of the cell's size (a 25-layer Transformer cell at 4 rows: 63 ms against
19 ms for its layers split one by one); cut per layer, it is the sum of its layers' costs, which is
what the calibration times."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gpipe_repro.engine import boundary
from gpipe_repro.engine.weight_kernels import run_direct

__all__ = ["split_backward_input", "full_backward", "backward_now", "reached_params", "LayerCuts",
           "cuts_layers", "split_by_layer"]


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
        left = run_direct(groups)   # one kernel call per convolution or norm, not an autograd call
        if left:
            stage_backward_weight(iter(params), left)  # type: ignore[arg-type]  # any leaf works
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


def cuts_layers(x: Any, num_layers: int, stage: int) -> bool:
    """Whether a forward on input `x` whose backward will be split is cut at every layer boundary:
    the cell has several layers and an input gradient to split off (a stage 0, whose input is the
    model's, or a cell with only integer inputs, runs its whole backward at W)."""
    return (num_layers > 1 and stage > 0
            and any(boundary.carries_grad(t) and t.requires_grad for t in boundary.tensors(x)))


class LayerCuts:
    """One micro-batch's forward graph cut at every layer boundary, recorded while it runs: per layer,
    its input (autograd leaves: :func:`boundary.cut`, same storage, no copy) and its output."""

    def __init__(self, x: Any) -> None:
        self.pieces: list[tuple[Any, Any]] = []
        self._input = x

    def cut(self, h: Any) -> Any:
        """The previous layer returned `h`: record its piece; return the next layer's input, `h` as
        new leaves (one per shared memory)."""
        self.pieces.append((self._input, h))
        self._input = boundary.cut(h)
        return self._input

    def close(self, h: Any) -> list[tuple[Any, Any]]:
        """The last layer returned `h`: the pieces, first layer first."""
        self.pieces.append((self._input, h))
        return self.pieces


def split_by_layer(outs: list[torch.Tensor], grads: list[torch.Tensor], x: Any,
                   pieces: list[tuple[Any, Any]] | None, param_order: Mapping[int, int],
                   model_input: bool) -> Callable[[], None]:
    """BACKWARD_INPUT of one micro-batch: the input gradient of the cell now (into the ``.grad`` of
    `x`'s leaves), layer by layer over `pieces` (:class:`LayerCuts`; None: the cell as one piece on
    input `x`), seeded by `outs`/`grads`; returns its BACKWARD_WEIGHT.

    While walking each layer's graph back to its input we keep the gradient arriving at each node
    where a parameter's gradient path joins it (PyTorch pipelining's ``stage_backward_input`` /
    ``get_param_groups`` do the same, :func:`split_backward_input`), so the weight half starts from
    there and walks only the parameters' branches. `model_input`: the first piece's input is the
    model's (stage 0): no stage waits for its gradient, and where it takes one (a caller's
    ``x.requires_grad_()``) the whole backward reaches it at W, as plain training's does; a piece
    with no floating input that needs a gradient runs its whole backward at W too. `param_order`:
    the cell's trainable parameters' positions (:func:`reached_params`)."""
    inputs = [inp for inp, _ in pieces] if pieces is not None else [x]
    works: list[Callable[[], None]] = []
    for k in range(len(inputs) - 1, -1, -1):
        if not outs:
            break                 # no gradient reaches this layer or any below it
        inp = inputs[k]
        leaves = ([] if k == 0 and model_input else
                  [t for t in boundary.tensors(inp) if boundary.carries_grad(t) and t.requires_grad])
        if not leaves:
            works.append(full_backward(outs, grads))
            break
        reached = reached_params(outs, param_order, leaves)
        if all(id(p) in param_order for p in reached):
            works.append(split_backward_input(outs, grads, leaves, reached))
        else:     # a leaf outside the cell (another cell's weight a loss reads): whole, now
            works.append(backward_now(outs, grads))
        if k > 0:                 # the cut's gradient seeds the layer below
            assert pieces is not None
            outs, grads = boundary.grad_pairs(pieces[k - 1][1], boundary.input_grads(inp))
            for t in leaves:
                t.grad = None

    def weights() -> None:
        for work in works:
            work()
    return weights
