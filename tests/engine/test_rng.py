"""Micro-batch splitting (tensor_split semantics), per-layer RNG and the recompute flag."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe, is_recomputing
from gpipe_repro.engine.microbatch import batch_size, join, split, split_sizes
from gpipe_repro.engine.rng import layer_seed, seed_layer


@pytest.mark.parametrize("n, m, sizes", [(10, 4, [3, 3, 2, 2]), (6, 4, [2, 2, 1, 1]), (7, 7, [1] * 7),
                                         (8, 1, [8])])
def test_exactly_m_microbatches_even_when_m_does_not_divide_n(n: int, m: int, sizes: list[int]) -> None:
    x = torch.arange(n)
    parts = split(x, m)
    assert [len(p) for p in parts] == sizes == split_sizes(n, m)
    assert torch.equal(join(parts), x)


def test_tuples_int_tensors_and_plain_values() -> None:
    x = (torch.randn(5, 2), torch.arange(5), torch.tensor(3.0), "tag", None)
    parts = split(x, 2)
    assert [p[0].shape[0] for p in parts] == [3, 2]
    assert all(p[2].item() == 3.0 and p[3] == "tag" and p[4] is None for p in parts)
    back = join(parts)
    assert torch.equal(back[1], x[1]) and back[3] == "tag"


def test_inconsistent_batch_sizes_and_m_too_large() -> None:
    with pytest.raises(ValueError, match="disagree on the batch size"):
        batch_size((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(ValueError, match="micro_batches=5 is larger than the batch size 4"):
        split(torch.zeros(4), 5)


def test_layer_seed_depends_on_every_coordinate() -> None:
    base = layer_seed(1, 2, 3, 4)
    assert base == layer_seed(1, 2, 3, 4)
    assert len({base, layer_seed(0, 2, 3, 4), layer_seed(1, 0, 3, 4), layer_seed(1, 2, 0, 4),
                layer_seed(1, 2, 3, 0)}) == 5
    seed_layer(1, 2, 3, 4)
    a = torch.rand(4)
    seed_layer(1, 2, 3, 4)
    assert torch.equal(torch.rand(4), a)


class CountsForwards(nn.Module):
    """A layer with a side effect that must happen once per real forward, not on recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = self.recomputes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_recomputing():
            self.recomputes += 1
        else:
            self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize("mode, recomputes", [("always", 4), ("except_last", 3), ("never", 0)])
def test_is_recomputing_lets_layers_skip_side_effects(mode: str, recomputes: int) -> None:
    layer = CountsForwards()
    pipe = GPipe([nn.Linear(3, 3), layer], partitions=2, micro_batches=4, checkpoint=mode,
                 loss_fn=nn.MSELoss(), optimizer=None)
    pipe.train_step(torch.randn(8, 3), torch.randn(8, 3))
    assert (layer.calls, layer.recomputes) == (4, recomputes)
    assert not is_recomputing()


def test_forward_is_pipelined_inference() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)]
    plain = nn.Sequential(*layers)
    expected = plain(torch.ones(7, 3))
    pipe = GPipe(layers, partitions=3, micro_batches=3)
    out = pipe(torch.ones(7, 3))
    torch.testing.assert_close(out, expected)
    assert not out.requires_grad


def test_training_state_round_trip() -> None:
    torch.manual_seed(0)
    make = lambda: GPipe([nn.Linear(3, 3), nn.Linear(3, 1)], partitions=2, micro_batches=2,  # noqa: E731
                         loss_fn=nn.MSELoss(), optimizer=lambda p: torch.optim.Adam(p, lr=0.1))
    a = make()
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    a.train_step(x, y)
    b = make()
    b.load_training_state(a.training_state())
    assert a.train_step(x, y) == b.train_step(x, y)
    with pytest.raises(ValueError, match="balance="):
        GPipe([nn.Linear(3, 3), nn.Linear(3, 1)], partitions=1).load_training_state(a.training_state())


def test_silent_gradients_a_layer_with_its_own_generator_was_not_replayed_on_recompute() -> None:
    """A dropout-like layer drawing from a ``torch.Generator`` of its own: under re-materialization
    (the default ``except_last``, and ``always``) its recompute drew the next mask, not the forward's,
    and every gradient of the cells before it was off by 0.11, silently. The reference is plain
    PyTorch on the whole batch: one draw of 12 rows from a generator in the same state is the two
    6-row draws of the micro-batches, in order."""
    class OwnDropout(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.g = torch.Generator().manual_seed(0)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h * (torch.rand(h.shape, generator=self.g) > 0.5) * 2 if self.training else h

    torch.manual_seed(0)
    x, y = torch.randn(12, 16), torch.randint(0, 4, (12,))
    layers = nn.Sequential(nn.Linear(16, 16), OwnDropout(), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(layers)
    nn.functional.cross_entropy(ref(x), y).backward()
    for checkpoint in ("never", "except_last", "always"):
        model = copy.deepcopy(layers)
        pipe = GPipe(model, partitions=2, micro_batches=2, balance=[2, 2], checkpoint=checkpoint,
                     loss_fn=nn.CrossEntropyLoss(), optimizer=None)
        pipe.train_step(x, y)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=checkpoint)
        # the stream goes on as after the forwards alone: the recompute drew nothing from it
        assert torch.equal(model[1].g.get_state(), _advanced(layers[1].g, (12, 16)))


def _advanced(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """`g`'s state after one draw of `shape` (on a copy)."""
    copy_ = torch.Generator().set_state(g.get_state())
    torch.rand(shape, generator=copy_)
    return copy_.get_state()
