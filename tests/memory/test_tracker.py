"""The storage tracker: allocations, frees, views, attribution; the same numbers on real and fake."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from gpipe_repro.memory.tracker import EXTERNAL, MemoryTracker


def _modes() -> list[tuple[str, FakeTensorMode | None]]:
    return [("real", None), ("fake", FakeTensorMode())]


@pytest.mark.parametrize("name,mode", _modes())
def test_allocation_free_and_views(name: str, mode: FakeTensorMode | None) -> None:
    ctx: contextlib.AbstractContextManager[object] = mode if mode is not None else contextlib.nullcontext()
    with ctx:
        x = torch.ones(1000)                     # made before tracking: external
        with MemoryTracker() as tracker:
            y = x * 2                            # 4000 bytes
            v = y.view(10, 100).t()              # a view: no new storage
            y.add_(1)                            # in place: nothing
            z = torch.cat([y, y])                # 8000 bytes
            del z
            live_after_free = tracker.total_live
        dev = tracker.devices["cpu"]
    assert dev.peak == 4000 + 8000
    assert live_after_free == 4000
    assert v.shape == (100, 10)
    del y, v
    assert tracker.total_live == 0


def test_real_and_fake_agree_on_a_training_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    results = []
    for mode in (None, FakeTensorMode()):
        m: nn.Module
        if mode is None:
            m, x = model, torch.randn(16, 32)
        else:
            from gpipe_repro.memory.fake import fake_module
            m = fake_module(model, mode)
            with mode:
                x = torch.empty(16, 32)
        with contextlib.ExitStack() as stack:
            if mode is not None:
                stack.enter_context(mode)
            tracker = stack.enter_context(MemoryTracker())
            m(x).square().mean().backward()
        results.append((tracker.devices["cpu"].peak, tracker.total_live))
        for p in m.parameters():
            p.grad = None
    assert results[0] == results[1]
    assert results[0][0] > 16 * 64 * 4           # at least the hidden activation


def test_scope_register_move_and_categories() -> None:
    params = torch.ones(256)                     # 1 KiB, pre-existing
    with MemoryTracker() as tracker:
        tracker.register(params, "dev0", "params")
        with tracker.scope("dev0", "activations"):
            a = params * 3                       # charged to dev0
        with tracker.scope("dev1"):
            b = torch.zeros(128)                 # 512 B on dev1
        tracker.move(a, "dev1", "stash")         # a transfer
    d0, d1 = tracker.devices["dev0"], tracker.devices["dev1"]
    assert d0.live == 1024 and d0.live_parts["params"] == 1024
    assert d1.live == 1024 + 512 and d1.live_parts["stash"] == 1024
    assert d0.peak == 2048                        # params + a, before the move
    assert tracker.key_of(a) != tracker.key_of(b)
    del a, b
    assert tracker.devices["dev1"].live == 0


def test_external_inputs_are_not_counted() -> None:
    big = torch.ones(10_000)
    with MemoryTracker(record_events=True) as tracker:
        small = big[:10].clone()                  # only the clone is charged
    assert tracker.total_peak == small.numel() * 4
    assert tracker.events is not None and len(tracker.events) == 1
    assert tracker._entries[id(big.untyped_storage())].category == EXTERNAL
