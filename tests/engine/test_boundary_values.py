"""Values that cross layers and cuts: named tuples keep their type, fields and gradients."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def test_a_named_tuple_crosses_cuts_and_comes_back_named() -> None:
    """A collections.namedtuple (or typing.NamedTuple) between layers, at a cut, inside a split cell
    and as the model's output: rebuilt with its fields, trained like plain PyTorch."""
    import collections
    import copy

    from gpipe_repro import GPipe
    Pair = collections.namedtuple("Pair", ["value", "gate"])

    class Make(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> Any:
            return Pair(self.lin(x), torch.sigmoid(x))

    class Use(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, p: Any) -> Any:
            assert isinstance(p, Pair), type(p)
            return Pair(self.lin(p.value) * p.gate, p.gate)

    class Head(nn.Module):
        def forward(self, p: Any) -> torch.Tensor:
            return p.value
    torch.manual_seed(0)
    layers = [Make(), Use(), Use(), Head()]
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    ref = nn.Sequential(*copy.deepcopy(layers))
    nn.MSELoss()(ref(x), y).backward()
    for schedule in ("gpipe", "zb-h1"):
        pipe = GPipe(copy.deepcopy(layers), partitions=2, balance=[2, 2], micro_batches=2,
                     loss_fn=nn.MSELoss(), optimizer=None, schedule=schedule)
        pipe.train_step(x, y)
        for p, q in zip(pipe.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    named = GPipe(copy.deepcopy(layers[:3]), partitions=2, micro_batches=2).eval()
    out = named(x)
    assert isinstance(out, Pair) and out.value.shape == (5, 6)
