"""Boundary specs: what the stage processes agree on once, and rebuild every step from raw tensors."""
from __future__ import annotations

import pytest
import torch

from gpipe_repro.distributed.transport import allocate, describe, rebuild, signature


def test_spec_rebuilds_nested_tuples_with_integer_bool_and_plain_values() -> None:
    value = (torch.randn(3, 4), (torch.arange(6).view(2, 3), torch.tensor([True, False])), 7, None,
             "causal", [torch.zeros(0), 2.5])
    spec = describe(value)
    assert spec == describe(tuple(v for v in value))       # comparable: the sender checks it
    hash(spec)                                              # hashable: it keys the cache
    buffers = allocate(spec, torch.device("cpu"))
    assert [(b.shape, b.dtype) for b in buffers] == [
        (torch.Size([3, 4]), torch.float32), (torch.Size([2, 3]), torch.int64),
        (torch.Size([2]), torch.bool), (torch.Size([0]), torch.float32)]
    sources = [value[0], value[1][0], value[1][1], value[5][0]]
    for b, src in zip(buffers, sources):
        b.copy_(src)
    rebuilt = rebuild(spec, iter(buffers))
    assert describe(rebuilt) == spec
    assert rebuilt[2:5] == (7, None, "causal") and isinstance(rebuilt[5], list)
    torch.testing.assert_close(rebuilt[1][0], value[1][0])


def test_signature_depends_on_shapes_dtypes_and_mode_only() -> None:
    a = [torch.randn(4, 3), torch.randn(3, 3)]
    same = [torch.zeros(4, 3), torch.ones(3, 3)]
    assert signature(a, True) == signature(same, True)
    assert signature(a, True) != signature(a, False)
    assert signature(a, True) != signature([torch.randn(4, 3), torch.randn(4, 3)], True)
    assert signature(a, True) != signature([t.double() for t in a], True)


def test_values_that_cannot_cross_are_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="tuples and plain values"):
        describe({"hidden": torch.zeros(1)})
