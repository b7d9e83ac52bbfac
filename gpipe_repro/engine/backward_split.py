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

from collections.abc import Callable, Container, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from gpipe_repro.engine import boundary
from gpipe_repro.engine.weight_kernels import run_direct

__all__ = ["split_backward_input", "full_backward", "LayerCuts",
           "cuts_layers", "split_by_layer"]


def split_backward_input(outs: list[torch.Tensor], grads: list[torch.Tensor], leaves: list[torch.Tensor],
                         params: Container[int] | Sequence[torch.Tensor],
                         only: Sequence[torch.Tensor] | None = None) -> Callable[[], None]:
    """Compute the input gradients of ``outs`` (seeded with ``grads``) into ``leaves[i].grad`` now;
    return the function that later computes the parameters' gradients into ``p.grad``.

    `params`: the parameters the split may defer (tensors, or their ids). The parameters are
    grouped as PyTorch pipelining's zero-bubble schedules group them
    (torch.distributed.pipelining._backward): by the nodes where their gradient paths meet the
    input's path (:func:`_param_groups`, one walk of the graph); pre-hooks on those nodes keep the
    gradients arriving there during the input pass, and the weight pass starts from them. Where the
    split cannot keep plain training's gradients, the whole backward runs now and nothing later,
    which is correct, only not split: the graph reaches a leaf other than `params` and `leaves` (a
    tensor a layer captured, another cell's weight a loss reads), or a parameter through a path that
    never meets the input's. `only`: where the whole backward runs now, it writes these tensors'
    gradients only (a measurement's: :func:`gpipe_repro.engine.layer_costs.measure_layer`)."""
    leaves = _distinct_leaves(leaves)
    cell = params if not isinstance(params, Sequence) else {id(p) for p in params}
    roots = [get_gradient_edge(t).node for t in outs if t.requires_grad]
    groups = _param_groups(roots, {id(t) for t in leaves}, cell)
    if groups is None:
        torch.autograd.backward(outs, grads, inputs=only)
        return lambda: None
    # Pre-hooks keep the gradient arriving at each join node in the input pass, after any hook on
    # the node's outputs has run (a GradientEdge among the pass's inputs would take it before).
    handles = []
    for group in groups:
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
    if any(kept is None for g in groups for kept in g["grads"]):
        # A join node no gradient reached: walk the retained graph again for the parameters only.
        used = [acc.variable for g in groups for acc in g["params"]]

        def weights_again() -> None:
            torch.autograd.backward(outs, grads, inputs=used)
        return weights_again

    def weights() -> None:
        left = run_direct(groups)   # one kernel call per convolution or norm, not an autograd call
        for n, group in enumerate(left):
            _group_through_autograd(group, retain_graph=n < len(left) - 1)
    return weights


def _group_through_autograd(group: dict[str, Any], retain_graph: bool) -> None:
    """A group's parameter gradients from its join nodes: :func:`_group_from_branches` where every
    join node can be called directly, else :func:`_group_from_join_nodes`."""
    if all(callable(node) for node in group["intermediates"]):
        _group_from_branches(group, retain_graph)
    else:
        _group_from_join_nodes(group, retain_graph)


def _group_from_branches(group: dict[str, Any], retain_graph: bool) -> None:
    """A group's parameter gradients from its join nodes (PyTorch pipelining's
    ``stage_backward_weight``, with one difference). Each join node's own backward is called on the
    gradient it kept in the input pass, directly: a node called so runs no hook, where seeding
    autograd at the node (as PyTorch's does) ran again every hook on the tensor it made, which the
    input pass had run (a user's gradient hook on an activation ran twice per micro-batch, the
    second time on what it had already returned). Autograd then walks from the node's parameter
    branches only (``group["branches"]``: the children off the input's path), which reach no other
    join node, so none is counted twice (a parameter that is a branch itself is one too: its own
    hooks run once, there). The graph is kept for the groups still to run (`retain_graph`)."""
    params = list(group["params"])
    edges, seeds = [], []
    for node, kept in zip(group["intermediates"], group["grads"]):
        if all(g is None for g in kept):
            continue
        with torch.no_grad():
            got = node(*kept)
        if isinstance(got, torch.Tensor):
            got = (got,)
        for j, kid, nr in group["branches"][node]:
            g = got[j]
            if g is None:
                continue
            edges.append(GradientEdge(kid, nr))
            seeds.append(_as_input_of(g, kid, nr))
    if not edges:
        return
    _into_grads(edges, seeds, params, retain_graph)


def _group_from_join_nodes(group: dict[str, Any], retain_graph: bool) -> None:
    """A group's parameter gradients by one autograd call from its join nodes, seeded with what
    each received in the input pass (PyTorch pipelining's ``stage_backward_weight``): for a group
    whose join node cannot be called directly (a custom ``autograd.Function``'s), where
    :func:`_group_from_branches` cannot start. A hook on a tensor a join node made runs again here
    (the gradient stays right: every join node is pinned to its kept gradient by a pre-hook, which
    runs after such hooks, so a walk from one join node that reaches another does not add to it).
    The graph is kept for the groups still to run (`retain_graph`): one group's walk may pass
    through another's join node, which would otherwise be freed before that group starts there."""
    edges, seeds = [], []
    for node, kept in zip(group["intermediates"], group["grads"]):
        for i, g in enumerate(kept):
            if g is not None:
                edges.append(GradientEdge(node, i))
                seeds.append(g)
    if not edges:
        return
    handles = [node.register_prehook(lambda _, kept=kept: kept)
               for node, kept in zip(group["intermediates"], group["grads"])]
    try:
        _into_grads(edges, seeds, list(group["params"]), retain_graph)
    finally:
        for h in handles:
            h.remove()


def _into_grads(edges: list[GradientEdge], seeds: list[torch.Tensor], params: list[Any],
                retain_graph: bool) -> None:
    """One autograd call from `edges` (seeded with `seeds`) into the ``.grad`` of `params` (their
    AccumulateGrad nodes), through AccumulateGrad itself, as plain training's backward: a
    parameter's hooks run, its post-accumulate-grad hooks too (an optimizer stepping in the
    backward, gradient logging), which capturing the gradients and adding them by hand skipped."""
    torch.autograd.backward(edges, seeds, inputs=[acc.variable for acc in params],
                            retain_graph=retain_graph)


def _as_input_of(grad: torch.Tensor, node: Any, nr: int) -> torch.Tensor:
    """`grad` as autograd's engine hands it to input `nr` of `node` (its ``validate_outputs``): a
    node's backward called directly returns a broadcast input's gradient at the broadcast shape,
    which the engine sums back to the input's, and casts it to the input's dtype and device."""
    meta = node._input_metadata[nr]
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    if grad.dtype != meta.dtype or grad.device != meta.device:
        grad = grad.to(device=meta.device, dtype=meta.dtype)
    return grad


_ACCUMULATE: Any = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


def _param_groups(roots: list[Any], inputs: set[int], cell: Container[int]) -> list[dict[str, Any]] | None:
    """The parameter groups of PyTorch pipelining's ``get_param_groups`` (each: ``params``, the
    AccumulateGrad nodes of parameters whose gradient paths meet the input's path at the same nodes,
    its ``intermediates``), from one walk of the graph below `roots` instead of one per parameter;
    None where the split cannot keep plain training's gradients (a leaf reached that is neither an
    input (`inputs`: ids) nor a parameter of `cell` (ids), or a parameter reached through a root
    whose path never meets the input's).

    The input's path is every node above an input's AccumulateGrad; an edge from a node on it to a
    node off it is where the parameters below that child join the path."""
    kids_of: dict[Any, list[Any]] = {}
    on_path: set[Any] = set()
    todo: list[Any] = list(roots)
    while todo:
        node = todo.pop()
        if node in kids_of:
            continue
        kids = [f for f, _ in node.next_functions if f is not None]
        kids_of[node] = kids
        if not kids and type(node) is _ACCUMULATE:
            leaf = id(node.variable)
            if leaf in inputs:
                on_path.add(node)
            elif leaf not in cell:
                return None
        todo.extend(kids)
    parents: dict[Any, list[Any]] = {}
    for node, kids in kids_of.items():
        for kid in kids:
            parents.setdefault(kid, []).append(node)
    todo = list(on_path)
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent not in on_path:
                on_path.add(parent)
                todo.append(parent)
    below: dict[Any, set[Any]] = {}

    def params_below(node: Any) -> set[Any]:
        return below[node] if node in below else _params_below(node, kids_of, below)

    if any(r not in on_path and params_below(r) for r in roots):
        return None
    group_of: dict[Any, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    branches: dict[Any, list[tuple[int, Any, int]]] = {}   # join node -> (position, child, its input)
    for node in kids_of:
        if node not in on_path:
            continue
        for j, (kid, nr) in enumerate(node.next_functions):
            if kid is None or kid in on_path:
                continue
            params = params_below(kid)
            if not params:
                continue
            branches.setdefault(node, []).append((j, kid, nr))
            if node not in group_of and params.isdisjoint(group_of):   # a join of its own
                group: dict[str, Any] = {"params": set(params), "intermediates": [node]}
                groups.append(group)
            else:
                found = {id(g): g for g in map(group_of.get, (node, *params)) if g is not None}
                group, *others = found.values()
                for other in others:          # merge: every member points at the one group
                    group["params"] |= other["params"]
                    group["intermediates"] += other["intermediates"]
                    for member in (*other["params"], *other["intermediates"]):
                        group_of[member] = group
                    groups.remove(other)
                if node not in group_of:
                    group["intermediates"].append(node)
                group["params"] |= params
            group_of[node] = group
            for acc in params:
                group_of[acc] = group
    for group in groups:
        group["branches"] = {node: branches[node] for node in group["intermediates"]}
    return groups


def _params_below(node: Any, kids_of: dict[Any, list[Any]], below: dict[Any, set[Any]]) -> set[Any]:
    """The AccumulateGrad nodes under `node`, a node off the input's path, memoized in `below`
    (children first, without recursion: no Python call depth limit, and no closure referring to
    itself that would keep the graph alive until the cyclic garbage collector runs)."""
    stack = [node]
    while stack:
        n = stack[-1]
        if n in below:
            stack.pop()
            continue
        kids = kids_of[n]
        pending = [k for k in kids if k not in below]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        below[n] = ({n} if not kids and type(n) is _ACCUMULATE
                    else set().union(*(below[k] for k in kids)))
    return below[node]


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
                   pieces: list[tuple[Any, Any]] | None, cell: Container[int],
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
    with no floating input that needs a gradient runs its whole backward at W too. `cell`: the ids
    of the cell's trainable parameters; a piece whose graph reaches another leaf (another cell's
    weight a loss reads, a tensor a layer captured) runs its backward whole, at once, as plain
    training's reaches it (:func:`split_backward_input`)."""
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
        works.append(split_backward_input(outs, grads, leaves, cell))
        if k > 0:                 # the cut's gradient seeds the layer below
            assert pieces is not None
            outs, grads = boundary.grad_pairs(pieces[k - 1][1], boundary.input_grads(inp))
            for t in leaves:
                t.grad = None

    def weights() -> None:
        for work in works:
            work()
    return weights
