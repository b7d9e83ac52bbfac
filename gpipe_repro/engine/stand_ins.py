"""The modules and parameters a pipeline runs in place of the caller's, and how they follow them.

GPipe trains the caller's own layers, but three things it must put in their place: a
:class:`~gpipe_repro.engine.batchnorm.DeferredBatchNorm` for each BatchNorm (with shallow copies of
the modules above it), in every cell but the first holding a parameter tied across cells, a
copy of that parameter (with shallow copies of the modules holding it; :mod:`gpipe_repro.engine.tied`),
and at each later place of a module given at several places, a shallow copy of it.
The caller keeps the originals, and plain PyTorch would train whatever the caller does to them
after the pipeline was built: ``model[3].eval()``, a new momentum or attribute on a block,
``model.load_state_dict(...)``, ``model[0].weight.requires_grad_(False)``.

:class:`StandIns` finds every stand-in by walking the caller's layers beside the cells (a module or
parameter at the same place that is not the same object) and, at the start of every step and
forward and in ``state_dict()`` (:meth:`StandIns.follow`), brings each up to date with its original:

- a module: every attribute of the original (its ``__dict__``, but for the module machinery:
  parameters, buffers, children and hooks, which a stand-in shares or replaces on purpose) that
  changed since the last look is set on the stand-in. ``pipe.train()``/``pipe.eval()`` set the
  originals' mode with the stand-ins' (:meth:`StandIns.set_mode`), so the two agree and a later
  ``model.train()`` is a change like any other; a buffer set in place of one
  (``bn.running_mean = ...``, or by a forward of the original's) is set in the stand-in, on the
  stand-in's device;
- a tied parameter's copy: the original's ``requires_grad`` where it changed, and its value where
  it was changed since the pipeline last updated it: its version counter moved (a
  ``load_state_dict``, an edit under no_grad) or its storage was replaced (``.data = ...``);
  :meth:`StandIns.updated` records the pipeline's own updates after each step. An in-place edit
  through ``.data`` moves neither and is not seen. The copy itself changed (and not alike with the
  original) is refused at the next step or forward (:meth:`StandIns.refuse_changed_copies`; the
  distributed runtime compares the copies at its gradient all-reduce instead);
- a replacement is refused (:class:`ReplacedAfterWrapping`): a layer of the container the caller
  gave, a child or parameter the stand-in keeps in a dictionary of its own, a tied parameter's
  shape. The stand-ins and the optimizers hold the objects they were built with.

The originals are held weakly: with the distributed runtime a process keeps only its own cells,
and the caller's model may be dropped (then there is nothing left to follow).

:func:`shown_to_optimizer` lets an optimizer factory that groups parameters by identity
(``p is model[0].weight``) find a tied parameter's copy: the factory is given the original in the
copy's place, and the optimizer then holds the copy.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ReplacedAfterWrapping", "StandIns", "shown_to_optimizer"]

#: A module's own machinery in its ``__dict__`` (parameters, buffers, children, hooks): not followed.
_MACHINERY = frozenset(nn.Module().__dict__) - {"training"}
_MISSING = object()


@dataclass
class _ModulePair:
    original: weakref.ref[nn.Module]
    stand_in: nn.Module
    name: str                                # where the original is in the caller's layers
    seen: dict[str, Any] = field(default_factory=dict)
    parts: dict[str, tuple[int, ...]] = field(default_factory=dict)   # what it does not share (_own_kinds)


@dataclass
class _ParameterPair:
    original: weakref.ref[nn.Parameter]
    copy: nn.Parameter
    seen_version: int
    seen_requires_grad: bool
    seen_storage: tuple[int, tuple[int, ...]]   # (data pointer, shape): `.data = ...` replaces them
    where: str                                  # the original's name in the caller's layers
    seen_copy: tuple[int, tuple[int, tuple[int, ...]]]   # the copy's (version, storage) as last set

    def copy_state(self) -> tuple[int, tuple[int, tuple[int, ...]]]:
        return self.copy._version, _storage(self.copy)


def _attributes(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in module.__dict__.items() if k not in _MACHINERY}


def _parts(module: nn.Module, kinds: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """The identities of `module`'s children, parameters or buffers (`kinds`), by kind."""
    return {kind: tuple(id(v) for v in getattr(module, kind).values()) for kind in kinds}


def _own_kinds(original: nn.Module, stand_in: nn.Module) -> tuple[str, ...]:
    """Which of children, parameters and buffers the stand-in keeps in a dictionary of its own: a
    replacement there would not reach it. (A shallow copy shares the others' dictionary with its
    original, so a replacement reaches both, and a module that sets its own buffer in its forward
    is not taken for the caller replacing it.)"""
    return tuple(kind for kind in ("_modules", "_parameters", "_buffers")
                 if getattr(original, kind) is not getattr(stand_in, kind))


def _storage(p: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return (p.data_ptr(), tuple(p.shape))


class ReplacedAfterWrapping(ValueError):
    """The caller replaced a module, parameter or buffer that a stand-in holds, after GPipe was built."""


class StandIns:
    """The stand-ins of one pipeline's cells (see the module docstring)."""

    def __init__(self, layers: Sequence[nn.Module], cells: Sequence[nn.Module]) -> None:
        """`layers`: the caller's layers, in order; `cells`: the cells made of them (every cell,
        before a process drops the others' layers)."""
        self.modules: list[_ModulePair] = []
        self.parameters: list[_ParameterPair] = []
        ran = [layer for cell in cells for layer in cell._modules.values() if layer is not None]
        if len(ran) != len(layers):
            raise AssertionError(f"{len(ran)} layers in the cells for {len(layers)} given")
        for i, (original, stand_in) in enumerate(zip(layers, ran)):
            self._walk(original, stand_in, f"layer {i}")
        self.container: weakref.ref[nn.Module] | None = None
        self.layer_ids: tuple[int, ...] = tuple(id(layer) for layer in layers)

    def watch(self, container: nn.Module) -> None:
        """The caller's own container of the layers (an nn.Sequential given to GPipe): a layer
        replaced in it afterwards (``model[4] = ...``) is refused at the next step, not ignored."""
        self.container = weakref.ref(container)

    def __deepcopy__(self, memo: dict[int, Any]) -> StandIns:
        """A deep copy of the pipeline is its own model: no caller's modules for it to follow."""
        empty = StandIns.__new__(StandIns)
        empty.modules, empty.parameters, empty.container, empty.layer_ids = [], [], None, ()
        return empty

    def __getstate__(self) -> dict[str, Any]:
        """A pipeline saved whole (``torch.save(pipe)``) loads as its own model, as a deep copy does."""
        return {"modules": [], "parameters": [], "container": None, "layer_ids": ()}

    def _walk(self, original: nn.Module, stand_in: nn.Module, name: str) -> None:
        if original is stand_in:
            return
        kinds = _own_kinds(original, stand_in)
        self.modules.append(_ModulePair(weakref.ref(original), stand_in, name, _attributes(original),
                                        _parts(original, kinds)))
        for key, p in original._parameters.items():
            q = stand_in._parameters.get(key)
            if p is not None and q is not None and q is not p:
                self.parameters.append(_ParameterPair(weakref.ref(p), q, p._version, p.requires_grad,
                                                      _storage(p), f"{name}.{key}",
                                                      (q._version, _storage(q))))
        for key, child in original._modules.items():
            other = stand_in._modules.get(key)
            if child is not None and other is not None:
                self._walk(child, other, f"{name}.{key}")

    def set_mode(self, training: bool) -> None:
        """``pipe.train()``/``pipe.eval()``: the originals of the stand-ins take the mode too, as the
        caller's other layers (the cells' own) do, so that the caller's model and the cells agree and
        a later ``model.train()``/``model.eval()`` is a change to follow."""
        for m in self.modules:
            original = m.original()
            if original is not None:
                original.training = training
                m.seen["training"] = training

    def keep_only(self, modules: Sequence[nn.Module]) -> None:
        """Forget the stand-ins outside `modules` (the cells this process keeps)."""
        kept = {id(m) for cell in modules for m in cell.modules()}
        held = {id(p) for cell in modules for p in cell.parameters()}
        self.modules = [pair for pair in self.modules if id(pair.stand_in) in kept]
        self.parameters = [pair for pair in self.parameters if id(pair.copy) in held]

    def copies(self) -> dict[int, nn.Parameter]:
        """id(a tied parameter's copy) -> its original, while the original lives."""
        out = {}
        for pair in self.parameters:
            original = pair.original()
            if original is not None:
                out[id(pair.copy)] = original
        return out

    def follow(self) -> None:
        """Bring every stand-in up to date with what changed in its original since the last look.
        A buffer set in place of another is set in the stand-in too. Raises
        :class:`ReplacedAfterWrapping` where a layer, or a module or parameter under a stand-in, was
        replaced (the stand-in and the optimizers hold the objects they were built with: a
        replacement would apply in some cells and not others)."""
        container = self.container() if self.container is not None else None
        if container is not None and tuple(
                id(v) for v in container._modules.values() if v is not None) != self.layer_ids:
            raise ReplacedAfterWrapping(
                "a layer of the model given to GPipe was replaced, added or removed after the "
                "pipeline was built: the pipeline runs the layers it was built with. Build GPipe "
                "from the model as it is now")
        for m in self.modules:
            original = m.original()
            if original is None:
                continue
            parts = _parts(original, tuple(m.parts))
            if "_buffers" in parts and parts["_buffers"] != m.parts["_buffers"]:
                _follow_buffers(original, m.stand_in)
                m.parts["_buffers"] = parts["_buffers"]
            if parts != m.parts:
                kind = next(k for k in parts if parts[k] != m.parts[k]).strip("_")
                raise ReplacedAfterWrapping(
                    f"{m.name} ({type(original).__name__}) had one of its {kind} replaced after "
                    "GPipe was built; the cells run a stand-in of it (a BatchNorm's, a module "
                    "holding a weight tied across cells, or one given at several places) and the "
                    "optimizers hold what it was built with, so the replacement would apply nowhere. "
                    "Replace it before building GPipe (load weights with load_state_dict, without "
                    "assign=True)")
            now = _attributes(original)
            for key in now.keys() | m.seen.keys():
                value = now.get(key, _MISSING)
                if value is not m.seen.get(key, _MISSING):
                    if value is _MISSING:
                        m.stand_in.__dict__.pop(key, None)
                    else:
                        m.stand_in.__dict__[key] = value
            m.seen = now
        for p in self.parameters:
            value = p.original()
            if value is None:
                continue
            if value.requires_grad is not p.seen_requires_grad:
                p.copy.requires_grad_(value.requires_grad)
                p.seen_requires_grad = value.requires_grad
            storage = _storage(value)
            if storage[1] != p.seen_storage[1]:
                raise ReplacedAfterWrapping(
                    f"a weight tied across cells changed shape after GPipe was built ({p.seen_storage[1]} "
                    f"-> {storage[1]}, e.g. resize_token_embeddings): its copies and the optimizers "
                    "hold the old shape. Resize before building GPipe")
            if value._version != p.seen_version or storage != p.seen_storage:
                with torch.no_grad():
                    p.copy.copy_(value)
                p.seen_version, p.seen_storage = value._version, storage
                p.seen_copy = p.copy_state()

    def refuse_changed_copies(self) -> None:
        """Raise ValueError where a tied parameter's copy (a later cell's) was changed in place since
        the pipeline last set it (an edit under no_grad, ``.data = ...``) and no longer equals the
        parameter itself: the copies would train apart, where plain PyTorch has one parameter (a
        change of the parameter itself, the caller's, is followed into every copy)."""
        for p in self.parameters:
            value = p.original()
            if value is None or p.copy_state() == p.seen_copy:
                continue
            if value.shape == p.copy.shape and torch.equal(value.detach(), p.copy.detach().to(value.device)):
                p.seen_copy = p.copy_state()      # changed alike: still one parameter
                continue
            raise ValueError(
                f"a later cell's copy of {p.where!r}, a weight tied across cells, was changed in place "
                "since the last step, and the weight itself was not: the copies would train apart "
                "(plain PyTorch has one parameter). Change the tied weight through the model given "
                f"to GPipe ({p.where!r} there: every copy follows it), or with pipe.load_state_dict, "
                "which sets every copy")

    def updated(self) -> None:
        """The pipeline updated its parameters (a step): the originals' values now are its own."""
        for p in self.parameters:
            original = p.original()
            if original is not None:
                p.seen_version, p.seen_storage = original._version, _storage(original)
            p.seen_copy = p.copy_state()


def _follow_buffers(original: nn.Module, stand_in: nn.Module) -> None:
    """The buffers `original` holds now, in `stand_in`'s own dictionary: a tensor set in their place
    (``bn.running_mean = ...``, or a forward that sets its buffer) on the stand-in's device."""
    for key in stand_in._buffers.keys() - original._buffers.keys():
        del stand_in._buffers[key]
    held = [t for t in (*stand_in._parameters.values(), *stand_in._buffers.values()) if t is not None]
    for key, value in original._buffers.items():
        old = stand_in._buffers.get(key)
        if value is not old:
            device = old.device if old is not None else held[0].device if held else None
            stand_in._buffers[key] = value if value is None or device is None else value.to(device)


def shown_to_optimizer(factory: Callable[[list[nn.Parameter]], Any], params: Sequence[nn.Parameter],
                       originals: Mapping[int, nn.Parameter]) -> Any:
    """``factory(params)`` with every tied parameter's copy shown as its original (`originals`: id of
    a copy -> the original), the optimizer then made to hold the copies instead (its param groups,
    and any state it made for them at construction)."""
    shown = [originals.get(id(p), p) for p in params]
    optimizer = factory(shown)
    back = {id(originals[id(p)]): p for p in params if id(p) in originals}
    if not back or not isinstance(getattr(optimizer, "param_groups", None), list):
        return optimizer
    for group in optimizer.param_groups:
        if isinstance(group, dict) and isinstance(group.get("params"), list):
            group["params"] = [back.get(id(p), p) for p in group["params"]]
    state = getattr(optimizer, "state", None)
    if isinstance(state, dict):
        for key in [k for k in state if id(k) in back]:
            state[back[id(key)]] = state.pop(key)
    return optimizer
