"""Boundary specs: what the stage processes agree on once, and rebuild every step from raw tensors."""
from __future__ import annotations

import collections

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


Hidden = collections.namedtuple("Hidden", ["hidden", "mask"])


class _Start(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 12)

    def forward(self, x: torch.Tensor) -> Hidden:
        h = self.lin(x)
        return Hidden(h, (h > 0).to(torch.int64))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(12, 4)

    def forward(self, t: Hidden) -> torch.Tensor:
        return self.lin(t.hidden) * (1 + t.mask[:, :4])


def _named_tuple_step(runtime: str) -> float:
    from gpipe_repro import GPipe

    torch.manual_seed(0)
    layers = torch.nn.Sequential(_Start(), _Block())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    pipe = GPipe(layers, partitions=2, micro_batches=2, runtime=runtime,
                 loss_fn=torch.nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    return [pipe.train_step(x, y) for _ in range(2)][-1]


def test_a_named_tuple_arrived_as_a_list_in_the_next_process() -> None:
    """A named tuple crossing a cut reached the next stage process as a list ('list' object has no
    attribute 'hidden'); it arrives as itself, and trains as the local runtime does."""
    from gpipe_repro.distributed import launch_local

    spec = describe(Hidden(torch.ones(2), 3))
    back = rebuild(spec, iter([torch.zeros(2)]))
    assert type(back) is Hidden and back.mask == 3
    ret = torch.max(torch.ones(2, 3), dim=1)
    assert type(rebuild(describe(ret), iter(list(ret)))) is type(ret)
    local = _named_tuple_step("local")
    assert launch_local(_named_tuple_step, 2, "distributed", job_timeout=120) == [pytest.approx(local)] * 2
    local_type = collections.namedtuple("Local", ["a"])
    with pytest.raises(TypeError, match="Local cannot cross between stage processes.*top level of a module"):
        describe(local_type(torch.ones(1)))
