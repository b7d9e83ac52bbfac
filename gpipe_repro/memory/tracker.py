"""Live bytes per device over time, measured from the lifetimes of tensor storages.

Why storages: memory is held by storages, not by tensors. A view, a ``detach()`` or an in-place op
shares its input's storage and costs nothing; a new storage is an allocation. A
:class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every op's outputs, so the first time a
storage appears it is charged (``nbytes``), and a weak reference on the storage object tells when it
is freed. The same code measures real tensors and ``FakeTensorMode``'s fake ones (their storages are
meta storages of the right size that hold no data): that is what lets the planner measure an
80B-parameter model on a laptop, and lets the tests check the fake measurement against a real run.

Attribution: an allocation is charged to the device label of the innermost :meth:`scope` (the
pipeline stage executing an action) or, outside any scope, to the tensor's device, and to a category
(parameters, gradients, stashed activations, ...). :meth:`move` re-charges a value to another label
(a transfer between devices). Storages that already existed when tracking began and are met as op
inputs are marked *external* and never counted (the caller's mini-batch); :meth:`register` counts
pre-existing tensors on purpose (parameters, optimizer state).

What it cannot see: memory a kernel allocates inside itself (workspaces), the caching allocator's
rounding and fragmentation (on CUDA each block is rounded up to 512 bytes: pass ``round_to=512``).
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

EXTERNAL = "external"
Label = Hashable


@dataclass
class _Entry:
    nbytes: int
    device: Label | None          # None: external, never counted
    category: str
    ref: weakref.ref
    serial: int                   # unique for the tracker's life (ids are reused after a free)


@dataclass(frozen=True)
class Mark:
    """One point of a device's timeline: after `label`, `live` bytes; `peak` bytes at most during it."""

    label: str
    live: int
    peak: int


@dataclass
class DeviceMemory:
    """What a tracker knows about one device label."""

    live: int = 0
    peak: int = 0
    live_parts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak_parts: dict[str, int] = field(default_factory=dict)
    peak_at: str = ""              # the label of the mark in progress when the peak was reached
    window_peak: int = 0           # peak since the last mark
    timeline: list[Mark] = field(default_factory=list)


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind a tensor, or None for tensors without one (sparse, nested, ...)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def value_tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class MemoryTracker(TorchDispatchMode):
    """Counts live storage bytes per device label (see the module docstring).

    ``with MemoryTracker() as tracker: ...`` then read :attr:`devices` (label -> :class:`DeviceMemory`)
    and :attr:`total_peak`. With ``record_events=True`` every charge is appended to :attr:`events` as
    ``(storage serial, label, delta bytes)``: the layer profiler replays them. A storage's serial
    (:meth:`key_of`) is never reused, unlike its ``id``, which a later storage may take once it is
    freed.
    """

    def __init__(self, record_events: bool = False, round_to: int = 1) -> None:
        super().__init__()
        self._entries: dict[int, _Entry] = {}
        self._scopes: list[tuple[Label | None, str | None]] = []
        self.devices: dict[Label, DeviceMemory] = defaultdict(DeviceMemory)
        self.total_live = 0
        self.total_peak = 0
        self.round_to = max(1, int(round_to))
        self.events: list[tuple[int, Label, int]] | None = [] if record_events else None
        self._mark_label: dict[Label, str] = defaultdict(str)
        self._serial = 0

    # -- the dispatch hook --------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._see_input(t)
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see_output(t)
        return out

    def _see_input(self, t: torch.Tensor) -> None:
        st = storage_of(t)
        if st is not None and id(st) not in self._entries:
            self._add(st, None, EXTERNAL)

    def _see_output(self, t: torch.Tensor) -> None:
        st = storage_of(t)
        if st is None or id(st) in self._entries:
            return
        device, category = self._scopes[-1] if self._scopes else (None, None)
        self._add(st, device if device is not None else str(t.device), category or "activation")

    # -- bookkeeping --------------------------------------------------------------------------------
    def _size(self, st: torch.UntypedStorage) -> int:
        n = st.nbytes()
        return -(-n // self.round_to) * self.round_to if n else 0

    def _add(self, st: torch.UntypedStorage, device: Label | None, category: str) -> None:
        key = id(st)
        nbytes = self._size(st)

        def collected(_ref: weakref.ref[torch.UntypedStorage]) -> None:
            self._free(key)

        ref = weakref.ref(st, collected)
        self._serial += 1
        self._entries[key] = entry = _Entry(nbytes, device, category, ref, self._serial)
        if device is not None:
            self._charge(entry.serial, device, category, nbytes)

    def _free(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.device is not None:
            self._charge(entry.serial, entry.device, entry.category, -entry.nbytes)

    def _charge(self, serial: int, device: Label, category: str, delta: int) -> None:
        if delta == 0:
            return
        d = self.devices[device]
        d.live += delta
        d.live_parts[category] += delta
        self.total_live += delta
        if self.events is not None:
            self.events.append((serial, device, delta))
        if delta > 0:
            if d.live > d.peak:
                d.peak = d.live
                d.peak_parts = {k: v for k, v in d.live_parts.items() if v}
                d.peak_at = self._mark_label[device]
            d.window_peak = max(d.window_peak, d.live)
            self.total_peak = max(self.total_peak, self.total_live)

    # -- the caller's controls ----------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, device: Label | None = None, category: str | None = None) -> Iterator[None]:
        """Charge allocations made inside to `device` (and `category`)."""
        outer = self._scopes[-1] if self._scopes else (None, None)
        self._scopes.append((device if device is not None else outer[0],
                             category if category is not None else outer[1]))
        try:
            yield
        finally:
            self._scopes.pop()

    def register(self, value: Any, device: Label, category: str) -> None:
        """Count the storages of `value` (tensors that existed before) on `device` as `category`."""
        for t in value_tensors(value):
            st = storage_of(t)
            if st is None:
                continue
            entry = self._entries.get(id(st))
            if entry is None:
                self._add(st, device, category)
            else:
                self._recharge(entry, device, category)

    def move(self, value: Any, device: Label, category: str | None = None) -> None:
        """Re-charge the (known) storages of `value` to `device`: a transfer between devices."""
        for t in value_tensors(value):
            st = storage_of(t)
            entry = self._entries.get(id(st)) if st is not None else None
            if entry is not None and entry.device is not None:
                self._recharge(entry, device, category or entry.category)

    def recategorize(self, value: Any, category: str) -> None:
        for t in value_tensors(value):
            st = storage_of(t)
            entry = self._entries.get(id(st)) if st is not None else None
            if entry is not None and entry.device is not None:
                self._recharge(entry, entry.device, category)

    def _recharge(self, entry: _Entry, device: Label, category: str) -> None:
        if entry.device is not None:
            self._charge(entry.serial, entry.device, entry.category, -entry.nbytes)
        entry.device, entry.category = device, category
        self._charge(entry.serial, device, category, entry.nbytes)

    def key_of(self, t: torch.Tensor) -> int | None:
        """The serial of `t`'s storage (an unseen storage is marked external first)."""
        st = storage_of(t)
        if st is None:
            return None
        if id(st) not in self._entries:
            self._add(st, None, EXTERNAL)
        return self._entries[id(st)].serial

    def begin(self, device: Label, label: str) -> None:
        """Start a timeline segment of `device` (e.g. an action); :meth:`mark` closes it."""
        d = self.devices[device]
        d.window_peak = d.live
        self._mark_label[device] = label

    def mark(self, device: Label, label: str | None = None) -> None:
        d = self.devices[device]
        label = label if label is not None else self._mark_label[device]
        d.timeline.append(Mark(label, d.live, max(d.window_peak, d.live)))
        d.window_peak = d.live

    def reset_peaks(self) -> None:
        """Forget the peaks so far (e.g. after a warm-up step); live bytes are kept."""
        for d in self.devices.values():
            d.peak, d.peak_parts, d.window_peak = d.live, {k: v for k, v in d.live_parts.items() if v}, d.live
            d.timeline.clear()
        self.total_peak = self.total_live
