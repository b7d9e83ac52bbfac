"""Parameters tied across cells: one copy per cell, gradients summed before any update.

A model may use one ``nn.Parameter`` in several layers (GPT-2 and most LLaMA-style models tie the
token embedding ``wte`` to the output projection ``lm_head``: the first and the last layer). When
the cut puts those layers in different cells, each cell keeps the parameter as its OWN copy (its
own ``nn.Parameter``, on its own device, updated by its own optimizer), as Megatron-LM's embedding
group and DeepSpeed's ``TiedLayerSpec`` do:

- :func:`untie` runs once, on the whole model's cells, before any cell is moved or dropped (every
  process of the distributed runtime computes the same :class:`Tie` list from the same model): the
  first cell holding the parameter keeps the original object, every other holding cell gets a
  clone, swapped into each of its submodules that held the original;
- at the step's agreement point, before the AGREE vector is computed, every copy's gradient is
  replaced by the SUM of all the copies' gradients (:func:`sum_tied_gradients` in one process;
  between processes one all-reduce per tie, :mod:`gpipe_repro.distributed.tied`). That sum is
  the tied parameter's gradient in plain training (autograd sums its uses), so global clipping and
  the fp16 overflow check see it; the global gradient norm counts it once, from the tie's first
  holder (:func:`uncounted_names`: the other holders leave their copy out of their contribution);
- every copy then gets the same update (same optimizer factory, same value, same gradient, same
  agreed factor), so the copies stay bit-identical step after step.

``state_dict()`` gives the tied value under each cell's name (equal tensors);
:func:`refuse_diverging_copies` makes ``load_state_dict`` refuse a state that gives the copies of a
tie different values, or only some of them. ``unpartitioned()`` returns the cells' layers, which
hold the copies: they are no longer one object.

A parameter used twice inside ONE cell stays one parameter: autograd sums its uses there.

One module object at several places (``nn.Sequential(block, block, block)``, as ALBERT shares its
layers; an activation module reused; a submodule held by two layers) is what plain PyTorch runs as
one set of weights used several times. :func:`separate_places` gives each later place its own
module object holding the same parameters and buffers, so that every place is a module of its own
(the pipeline runs, re-materializes and cuts layers one place at a time) and the shared weights are
tied parameters as above.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.backward_split import needs_whole_gradient

__all__ = ["Tie", "find_ties", "refuse_buffers_across_devices", "separate_places", "untie",
           "tied_copies", "copies_sum", "set_gradients", "sum_tied_gradients", "uncounted_names",
           "refuse_diverging_copies", "refuse_hooked_copies", "refuse_renormalized_copies",
           "refuse_copies_diverged_in_step", "tied_names"]


@dataclass(frozen=True)
class Tie:
    """One parameter held by several cells.

    Attributes:
        holders: (cell index, the parameter's name in that cell), one per holding cell, in cell
            order. The first holder keeps the original parameter and counts it in the global norm.
    """
    holders: tuple[tuple[int, str], ...]

    @property
    def cells(self) -> list[int]:
        """The cells holding a copy, in order."""
        return [c for c, _ in self.holders]


def find_ties(cells: Sequence[nn.Module]) -> list[Tie]:
    """Every parameter held by more than one cell, in the order of its first holder's parameters."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for c, cell in enumerate(cells):
        for name, p in cell.named_parameters():   # each parameter once per cell
            holders.setdefault(id(p), []).append((c, name))
    return [Tie(tuple(h)) for h in holders.values() if len(h) > 1]


def separate_places(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """`layers` where a module object already met in an earlier layer is a module of its own holding
    the same parameters and buffers (its children the same way): a shallow copy sharing the
    module's dictionaries of parameters and buffers (:func:`untie` then gives a copy in another cell
    a parameter of its own; a buffer the forward sets anew is seen at every place, as in plain
    PyTorch), so that the caller's layers are unchanged and the copies follow them as stand-ins do
    (engine.stand_ins). A module used twice inside one layer stays as it is there: that layer runs
    it as plain PyTorch does. :func:`refuse_buffers_across_devices` refuses places holding buffers
    in cells on different devices (one dictionary cannot hold a tensor on each)."""
    met: set[int] = set()
    out = []
    for layer in layers:
        out.append(_own_place(layer, met, {}))
        met.update(id(m) for m in layer.modules())
    return out


def _own_place(module: nn.Module, met: set[int], done: dict[int, nn.Module]) -> nn.Module:
    if id(module) in done:             # used twice within this layer: one module there, as given
        return done[id(module)]
    children = {key: child if child is None else _own_place(child, met, done)
                for key, child in module._modules.items()}
    if id(module) in met or any(children[key] is not child for key, child in module._modules.items()):
        placed = copy.copy(module)     # sharing the module's dictionaries of parameters and buffers
        placed._modules = children
    else:
        placed = module
    done[id(module)] = placed
    return placed


def refuse_buffers_across_devices(cells: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
    """ValueError, before anything moves, where a module given at several places holds buffers and
    its places are in cells on different devices: the places share one dictionary of buffers (a
    buffer the forward sets anew is seen at every place), which cannot hold a tensor on each."""
    where: dict[int, tuple[int, str]] = {}
    for c, cell in enumerate(cells):
        for name, module in cell.named_modules(remove_duplicate=False):
            if not module._buffers:
                continue
            first = where.setdefault(id(module._buffers), (c, name))
            if torch.device(devices[first[0]]) != torch.device(devices[c]):
                raise ValueError(
                    f"the module {name!r} of cell {c} is given at several places, and holds buffers "
                    f"({', '.join(module._buffers)}) that its place {first[1]!r} in cell {first[0]} "
                    f"holds too, on {devices[first[0]]} where cell {c} is on {devices[c]}: give each "
                    "place its own module (copy.deepcopy, then tie its parameters to the first's), "
                    "or a balance that keeps those places on one device")


def untie(cells: Sequence[nn.Module]) -> list[Tie]:
    """Give every cell but the first holder of each tie its own copy of the tied parameter (see the
    module docstring) and return the ties. The cells hold no module in common
    (:func:`separate_places`)."""
    ties = find_ties(cells)
    for tie in ties:
        first, name = tie.holders[0]
        original = cells[first].get_parameter(name)
        for c, _ in tie.holders[1:]:
            own = nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad)
            for key, child in cells[c]._modules.items():
                if child is not None:
                    cells[c]._modules[key] = _holding(child, original, own)
    return ties


def _holding(module: nn.Module, original: nn.Parameter, own: nn.Parameter) -> nn.Module:
    """`module` with `own` where it holds `original`: shallow copies down to the modules holding it
    (their other parameters, buffers and children the same objects), so the caller's model keeps
    its tie (a later plain step on it trains one weight, as before it was pipelined); `module`
    itself where it holds no `original`."""
    children = {key: _holding(child, original, own) for key, child in module._modules.items()
                if child is not None}
    holds = [key for key, p in module._parameters.items() if p is original]
    if not holds and all(children[key] is module._modules[key] for key in children):
        return module
    copied = copy.copy(module)
    copied._parameters = {key: own if key in holds else p for key, p in module._parameters.items()}
    copied._modules = {**module._modules, **children}
    return copied


def tied_copies(tie: Tie, cells: Mapping[int, nn.Module]) -> list[nn.Parameter]:
    """The copies of `tie` held by `cells` (stage -> cell: the cells of this process)."""
    return [cells[c].get_parameter(name) for c, name in tie.holders if c in cells]


def copies_sum(copies: Sequence[nn.Parameter]) -> torch.Tensor | None:
    """The sum of the copies' gradients, in holder order, added in place into the first gradient
    present (no tensor of the matrix's size is allocated); None when none has a gradient."""
    grads = [p.grad for p in copies if p.grad is not None]
    if not grads:
        return None
    total = grads[0]
    for g in grads[1:]:
        total.add_(g.to(total.device))
    return total


def set_gradients(copies: Sequence[nn.Parameter], total: torch.Tensor) -> None:
    """Make every copy's gradient `total` (each its own tensor, on its own device; in place where it
    has one, so a gradient that is a view of a data-parallel bucket stays one)."""
    for p in copies:
        if p.grad is total:
            continue
        if p.grad is not None and p.grad.shape == total.shape and p.grad.dtype == total.dtype:
            p.grad.copy_(total)
        else:
            p.grad = total.to(p.device, copy=True)


def sum_tied_gradients(ties: Sequence[Tie], cells: Mapping[int, nn.Module]) -> None:
    """One process holding every copy: each copy's gradient becomes the sum of all of them."""
    for tie in ties:
        copies = tied_copies(tie, cells)
        total = copies_sum(copies)
        if total is not None:
            set_gradients(copies, total)


def tied_names(ties: Sequence[Tie], stage: int) -> frozenset[str]:
    """The names, in cell `stage`, of its copies of parameters tied across cells."""
    return frozenset(name for tie in ties for c, name in tie.holders if c == stage)


def refuse_renormalized_copies(ties: Sequence[Tie], cells: Sequence[nn.Module]) -> None:
    """Refuse, before any work, an embedding that renormalizes its weight in place in every forward
    (``max_norm``) where that weight is tied across cells: the change lands in its own cell's copy,
    and the other cells' copies would go on without it (a max_norm embedding tied to the head
    trained a loss 0.17 off plain PyTorch's, silently)."""
    for tie in ties:
        for cell, name in tie.holders:
            owner = cells[cell].get_submodule(name.rpartition(".")[0])
            if isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) and owner.max_norm is not None:
                raise ValueError(
                    f"{type(owner).__name__} {name!r} of cell {cell} has max_norm={owner.max_norm}, "
                    "which renormalizes its weight in place in every forward, and that weight is "
                    f"tied across cells {', '.join(str(c) for c in tie.cells)}: each cell holds a "
                    "copy, and the others would not see the change. Keep the layers that share it in "
                    "one cell (balance=...), or renormalize between steps instead of max_norm")


def refuse_copies_diverged_in_step(ties: Sequence[Tie], cells: Mapping[int, nn.Module],
                                   versions: Mapping[int, Mapping[str, int]]) -> None:
    """Refuse a step, at its AGREE (before any update), in which a tie's copies held here stopped
    being equal: one was changed in place (its version counter moved since `versions`, per cell,
    read when the step began) and the others not alike. A layer that clamps or renormalizes its own
    weight in its forward changes its own cell's copy only (the same module at two places changes
    each copy alike, and passes)."""
    for tie in ties:
        copies = [(c, name, cells[c].get_parameter(name)) for c, name in tie.holders if c in cells]
        if all(p._version == versions.get(c, {}).get(name) for c, name, p in copies):
            continue
        first = copies[0][2].detach()
        if any(not torch.equal(p.detach().to(first.device), first) for _, _, p in copies[1:]):
            changed = [f"{name!r} of cell {c}" for c, name, p in copies
                       if p._version != versions.get(c, {}).get(name)]
            raise ValueError(
                f"parameter {', '.join(changed)}, tied across cells "
                f"{', '.join(str(c) for c in tie.cells)}, was changed in place during the step (a "
                "layer's forward clamping or renormalizing its own weight) and its copies in the "
                "other cells were not: the step is refused before any update. Keep the layers that "
                "share it in one cell (balance=...), or change the weight between steps")


def uncounted_names(ties: Sequence[Tie], stage: int) -> frozenset[str]:
    """The names, in cell `stage`, of the copies another cell counts in the global gradient norm."""
    return frozenset(name for tie in ties for c, name in tie.holders[1:] if c == stage)


def refuse_diverging_copies(pipe: nn.Module, ties: Sequence[Tie]) -> None:
    """Make ``pipe.load_state_dict`` refuse, before loading anything, a state that gives a tie's
    copies (``cells.<c>.<name>``) different values, or a value for some of them and not the others;
    the copies would no longer be one parameter. (Each process of the distributed runtime checks the
    copies it holds.)"""
    pipe.register_load_state_dict_pre_hook(_DivergingCopiesCheck(tuple(ties)))


class _DivergingCopiesCheck:
    """:func:`refuse_diverging_copies`'s hook (a class, not a closure: a pipeline saved whole with
    ``torch.save(pipe)`` pickles its hooks)."""

    def __init__(self, ties: tuple[Tie, ...]) -> None:
        self.ties = ties

    def __call__(self, module: nn.Module, state: Mapping[str, Any], prefix: str, *args: Any) -> None:
        for tie in self.ties:
            keys = [f"{prefix}cells.{c}.{name}" for c, name in tie.holders
                    if len(module.cells[c]) > 0]   # type: ignore[index]
            given = [k for k in keys if k in state]
            if given and len(given) != len(keys):
                missing = sorted(set(keys) - set(given))
                raise ValueError(f"the state gives the tied parameter {given[0]!r} but not its copies "
                                 f"{missing}: give the tied value under every name, or under none")
            values = [state[k] for k in given]
            if any(not torch.equal(v.cpu(), values[0].cpu()) for v in values[1:]):
                raise ValueError(f"the state gives the tied parameter different values under {given}: "
                                 "its copies must stay one parameter; give the same value under every "
                                 "name")


def refuse_hooked_copies(ties: Sequence[Tie], cells: Mapping[int, nn.Module]) -> None:
    """Refuse, before a step's work, a gradient hook on a parameter tied across cells: each cell
    holds its own copy, and a hook on one copy would run on that cell's share of the gradient, where
    plain training's runs once on the sum of every use (a hook scaling the gradient by 0.5 scaled the
    embedding's share only)."""
    for tie in ties:
        for cell, name in tie.holders:
            if cell in cells and needs_whole_gradient(cells[cell].get_parameter(name)):
                held = ", ".join(str(c) for c in tie.cells)
                raise ValueError(
                    f"parameter {name!r} of cell {cell} has a gradient hook, and it is tied across "
                    f"cells {held}: each cell holds a copy, and the hook would see one cell's share "
                    "of its gradient, where plain training's sees the sum of every use. Keep the "
                    "layers that share it in one cell (balance=...), or read the summed gradient "
                    "after train_step (every copy's p.grad holds it until the next step)")
