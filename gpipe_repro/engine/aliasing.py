"""Tensors of one boundary value that share memory, and how that sharing survives a copy or a cut.

A layer may return one tensor twice, ``(h, h)``, or a tensor and a view of it, ``(h, h[0])``. In
plain PyTorch the next layer modifying ``t[0]`` in place changes ``t[1]`` too, and the gradient of
``h`` is the sum of what flowed through both items. A pipeline that copies, casts, sends or detaches
each tensor on its own would give the next cell independent tensors: a silently wrong answer.

So every operation that makes a new value from a boundary value (:func:`map_tensors`: detach,
attach, a cast, the in-place guard's copy, a message) makes one new tensor per *carrier* and rebuilds
the tensors that alias it from that one:

- tensors that overlap in memory form a group; the group travels as one tensor, its carrier;
- a tensor with the carrier's geometry (dtype, shape, strides, offset) is rebuilt as the carrier
  itself (``(h, h)`` arrives as one tensor, twice);
- any other tensor of the group is rebuilt as a view of the carrier (``as_strided``) when the carrier
  is contiguous, has their dtype and holds all of their memory (``(h, h[0])``, ``(h, h.t())``);
- anything else (views that partly overlap, neither holding the other; one storage read as two
  dtypes) cannot be rebuilt: refused, with an error saying what to return instead, where a value
  leaves a layer for a cut; elsewhere (a model's input or target) those tensors stay unshared.

Tensors that share a storage without overlapping (``h[:, :2]`` and ``h[:, 2:]``) cannot see each
other's writes, so they travel independently. The :data:`Layout` of a value says, per tensor leaf,
whether it travels or which carrier it is rebuilt from; it is a function of the value's geometry
alone, so a sender and its receiver compute the same one.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gpipe_repro.engine import microbatch

__all__ = ["Alias", "Layout", "AliasingError", "leaves", "layout", "travelling", "expand", "map_tensors"]


@dataclass(frozen=True)
class Alias:
    """A tensor leaf rebuilt from the carrier at leaf index `carrier` of the same value: the carrier
    itself (`view` None), or its view of (shape, strides, offset from the carrier's offset)."""
    carrier: int
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None = None


# Per tensor leaf (in :func:`leaves` order): None where it travels itself, else how it is rebuilt.
Layout = tuple[Alias | None, ...]


class AliasingError(ValueError):
    """Tensors of one boundary value share memory in a way the pipeline cannot rebuild."""


def leaves(value: Any) -> list[torch.Tensor]:
    """Tensor leaves of `value` in a fixed depth-first order (that of ``boundary.tensors``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in leaves(v)]
    return []


def _put(value: Any, new: Iterator[torch.Tensor]) -> Any:
    """`value` with its tensor leaves replaced, in order, by those of `new`."""
    if isinstance(value, torch.Tensor):
        return next(new)
    if isinstance(value, (tuple, list)):
        return microbatch.rebuild(value, [_put(v, new) for v in value])
    return value


def _storage(t: torch.Tensor, i: int) -> Any:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):   # sparse, nested: no storage of their own
        return ("own", i)


def _geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return t.dtype, tuple(t.shape), tuple(t.stride()), _offset(t)


def _offset(t: torch.Tensor) -> int:
    return int(t.storage_offset())


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a non-empty tensor reaches: [first, end)."""
    size = t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return _offset(t) * size, (_offset(t) + last + 1) * size


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two non-empty tensors of one storage share an element."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.dtype != b.dtype or _geometry(a) == _geometry(b):
        return True
    # Interleaved views (h[:, ::2] and h[:, 1::2]) span the same bytes without sharing an element.
    first = min(_offset(a), _offset(b))
    index = torch.arange(max(a1, b1) // a.element_size() - first)
    seen = torch.zeros(index.numel(), dtype=torch.bool)
    seen[index.as_strided(tuple(a.shape), a.stride(), _offset(a) - first).reshape(-1)] = True
    return bool(seen[index.as_strided(tuple(b.shape), b.stride(), _offset(b) - first).reshape(-1)].any())


def _holds(carrier: torch.Tensor, t: torch.Tensor) -> bool:
    (c0, c1), (t0, t1) = _span(carrier), _span(t)
    return carrier.is_contiguous() and carrier.dtype == t.dtype and c0 <= t0 and t1 <= c1


def layout(tensors: list[torch.Tensor], where: str | None = "a value crossing between cells") -> Layout:
    """How the tensors of one value (its :func:`leaves`) travel: see the module docstring. Raises
    :class:`AliasingError` for sharing that cannot be rebuilt, naming the value `where`; with `where`
    None such tensors travel each on its own instead (a model's input or target, a received value
    its sender already checked)."""
    group = list(range(len(tensors)))

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i
    by_storage: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() > 0:
            by_storage.setdefault(_storage(t, i), []).append(i)
    for members in by_storage.values():
        for n, i in enumerate(members):
            for j in members[:n]:
                if root(i) != root(j) and _overlap(tensors[i], tensors[j]):
                    group[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(tensors)):
        groups.setdefault(root(i), []).append(i)
    result: list[Alias | None] = [None] * len(tensors)
    for members in groups.values():
        if len(members) == 1:
            continue
        same = {_geometry(tensors[i]) for i in members}
        holders = [c for c in members if all(_holds(tensors[c], tensors[i]) for i in members)]
        if len(same) > 1 and not holders:
            if where is None:
                continue
            raise AliasingError(
                f"{where} holds tensors (#{', #'.join(map(str, members))} of its tensors, in order) "
                "that overlap in memory as different views, none of them contiguous and holding the "
                "others (or one memory read as two dtypes), which the pipeline cannot rebuild as "
                "views of one tensor on the other side of the cut. Return the tensor once and take "
                "the views in the next layer, or return a copy (.clone()) of all but one of them")
        carrier = members[0] if len(same) == 1 else holders[0]
        c = tensors[carrier]
        for i in members:
            t = tensors[i]
            if i != carrier:
                result[i] = Alias(carrier, None if _geometry(t) == _geometry(c) else
                                  (tuple(t.shape), tuple(t.stride()), _offset(t) - _offset(c)))
    return tuple(result)


def travelling(tensors: list[Any], lay: Layout | None) -> list[Any]:
    """The tensors (or their descriptions) that travel: the carriers and the unaliased ones."""
    return list(tensors) if lay is None else [t for t, a in zip(tensors, lay) if a is None]


def expand(lay: Layout | None, carriers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor leaf, rebuilt from the :func:`travelling` ones (new carriers of the same shapes
    and strides as the old ones had)."""
    if lay is None:
        return list(carriers)
    sent = iter(carriers)
    out: list[torch.Tensor | None] = [None] * len(lay)
    for i, a in enumerate(lay):
        if a is None:
            out[i] = next(sent)
    views: dict[tuple[int, Any], torch.Tensor] = {}
    for i, a in enumerate(lay):
        if a is None:
            continue
        base = out[a.carrier]
        assert base is not None
        if a.view is None:
            out[i] = base
            continue
        if not base.is_contiguous():
            raise RuntimeError("a carrier of aliased boundary tensors lost its contiguous layout; "
                               "the function mapping it must keep shapes and strides")
        shape, stride, offset = a.view
        key = (a.carrier, a.view)
        if key not in views:
            views[key] = base.as_strided(shape, stride, base.storage_offset() + offset)
        out[i] = views[key]
    return [t for t in out if t is not None]


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor], where: str | None = None) -> Any:
    """`value` with `fn` applied once per carrier and the tensors aliasing it rebuilt from the result
    (same structure). `fn` must keep shapes and strides (detach, ``to``, clone, ``view_as``). Sharing
    that cannot be rebuilt is refused naming the value `where`, or left unshared where it is None
    (:func:`layout`)."""
    if isinstance(value, torch.Tensor):   # one tensor: nothing can alias it
        return fn(value)
    tensors = leaves(value)
    if len(tensors) < 2:
        return _put(value, iter([fn(t) for t in tensors]))
    lay = layout(tensors, where)
    return _put(value, iter(expand(lay, [fn(t) for t in travelling(tensors, lay)])))
