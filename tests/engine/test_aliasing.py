"""Tensors of one boundary value that share memory stay shared across cuts, copies and casts.

A layer returning ``(h, h, h.t(), ids, 0.5)`` followed, across a cut, by a layer writing into ``t[0]``
and ``t[2]`` in place: in plain PyTorch every item sees both writes and ``h``'s gradient is the sum
over the items. Each test compares the pipeline with the plain-PyTorch reference of
tests/equivalence.py (loss, every gradient and update), which never calls engine code.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.engine import aliasing, boundary
from gpipe_repro.engine.precision import cast_boundary
from tests.equivalence import assert_same_training


class Shared(nn.Module):
    """Returns one tensor twice, a view of it, an integer tensor and a plain value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x).float()      # fp32 under autocast too: the boundary cast has work to do
        return h, h, h.t(), (x > 0).long().sum(1), 0.5


class WriteInPlace(nn.Module):
    """Writes into the first item and into the view: plain PyTorch's other items see both."""

    def forward(self, t: Any) -> Any:
        t[0].mul_(3)
        t[2].add_(1)
        return t


class Combine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, t: Any) -> torch.Tensor:
        h, again, view, ids, scale = t
        return self.lin(h) + 2 * again + view.t() * scale + ids.unsqueeze(1).float()


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(4, 4), Shared(), WriteInPlace(), Combine()]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)


@pytest.mark.parametrize("balance", [[2, 2], [1, 3]])   # across cells; inside a cell (zb-h1's cuts)
@pytest.mark.parametrize("schedule,checkpoint", [("gpipe", "never"), ("gpipe", "always"),
                                                 ("1f1b", "except_last"), ("zb-h1", "never"),
                                                 ("zb-h1", "always")])
def test_silent_aliased_tuple_items_stay_aliased_across_a_cut(schedule: str, checkpoint: str,
                                                              balance: list[int]) -> None:
    x, y = batch()
    assert_same_training(layers(), x, y, nn.MSELoss(), partitions=2, micro_batches=2,
                         checkpoint=checkpoint, schedule=schedule, balance=balance, steps=2)


def test_silent_aliased_tuple_items_stay_aliased_in_the_eval_forward() -> None:
    x, _ = batch()
    ref = nn.Sequential(*layers()).eval()
    for balance in ([2, 2], [1, 3]):
        pipe = GPipe(layers(), partitions=2, balance=balance, micro_batches=2).eval()
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), ref(x), rtol=1e-5, atol=1e-6)


def test_silent_aliased_tuple_items_stay_aliased_under_bf16() -> None:
    """The boundary cast makes one bf16 tensor per shared memory (the reference keeps fp32 between
    layers, so the tolerance is bf16's; losing the aliasing is off by far more)."""
    x, y = batch()
    assert_same_training(layers(), x, y, nn.MSELoss(), partitions=2, micro_batches=2,
                         checkpoint="except_last", schedule="zb-h1", balance=[2, 2],
                         precision="bf16", low_precision_boundaries=True, rtol=5e-2, atol=5e-2)
    h = torch.randn(3, 4)
    cast = cast_boundary((h, h, h.t(), h[1], torch.arange(3), 2), "bf16", low=True)
    assert cast[0] is cast[1] and cast[0].dtype == torch.bfloat16
    assert cast[2]._base is cast[0] and cast[3]._base is cast[0]
    assert torch.equal(cast[2], cast[0].t()) and torch.equal(cast[3], cast[0][1])


def test_sharing_is_rebuilt_for_views_and_left_alone_for_disjoint_memory() -> None:
    h = torch.randn(4, 6)
    shared = (h, h[1], h.t(), h.view(-1))
    lay = aliasing.layout(list(shared))
    assert lay[0] is None and all(a is not None and a.carrier == 0 for a in lay[1:])
    copied = aliasing.map_tensors(shared, torch.clone)
    copied[1].fill_(7)
    assert torch.equal(copied[0][1], torch.full((6,), 7.0)) and torch.equal(copied[3], copied[0].reshape(-1))
    assert copied[2]._base is copied[0] and torch.equal(copied[2], copied[0].t())
    rows = aliasing.map_tensors((h[1:], h[2]), torch.Tensor.detach)   # a carrier not at offset 0
    assert rows[1].data_ptr() == h[2].data_ptr() and torch.equal(rows[1], h[2])
    assert aliasing.layout([h[:, :3], h[:, 3:]]) == (None, None)
    assert aliasing.layout([h[:, ::2], h[:, 1::2]]) == (None, None)    # interleaved, no shared element
    assert aliasing.layout([h, h.detach()])[1] == aliasing.Alias(0)


def test_aliased_items_that_cannot_be_rebuilt_are_refused_before_any_update() -> None:
    """Views that partly overlap, neither holding the other, cannot be rebuilt as views of one
    tensor; a detached alias cannot take its share of one gradient. Both fail the step, naming the
    fix, before any cell updates."""
    class PartlyOverlapping(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            h = x * 2
            return h[:, :3], h[:, 1:]

    class DetachedAlias(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            h = x * 2
            return h, h.detach()

    class Add(nn.Module):
        def forward(self, t: Any) -> torch.Tensor:
            return t[0].sum(1, keepdim=True) + t[1].sum(1, keepdim=True)
    x, y = batch()
    for middle, fix in ((PartlyOverlapping(), "overlap in memory as different views"),
                        (DetachedAlias(), "share memory but not their autograd graph")):
        torch.manual_seed(0)
        model = [nn.Linear(4, 4), middle, Add()]
        before = copy.deepcopy(model[0].state_dict())
        pipe = GPipe(model, partitions=2, balance=[2, 1], micro_batches=2, loss_fn=nn.MSELoss(),
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        with pytest.raises(aliasing.AliasingError, match=fix) as caught:
            pipe.train_step(x, y[:, :1])
        assert ".clone()" in str(caught.value)
        if isinstance(middle, PartlyOverlapping):       # where: the cut and the layer
            assert "the output of cell 0 (its last layer" in str(caught.value)
            assert "PartlyOverlapping), sent to cell 1" in str(caught.value)
        for name, value in pipe.cells[0][0].state_dict().items():
            assert torch.equal(value, before[name]), name


def test_a_models_input_of_partly_overlapping_views_is_not_refused() -> None:
    """Shifted views of one tensor (a sequence and its next-step shift) as the model's input: no
    cut has to rebuild them, so they are fed as before."""
    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 4)

        def forward(self, t: Any) -> torch.Tensor:
            return self.lin(t[0]) + self.lin(t[1])
    x, y = batch()
    torch.manual_seed(0)
    assert_same_training([Shifted(), nn.Linear(4, 4)], (x[:, :3], x[:, 1:]), y, nn.MSELoss(),
                         partitions=2, micro_batches=2, checkpoint="never")


def test_one_gradient_per_shared_memory_crosses_back() -> None:
    """The receiver's leaf collects the summed gradient once; the producer seeds it once."""
    h = torch.randn(3, 4, requires_grad=True) * 1
    received = boundary.attach(boundary.detach((h, h, h.t(), torch.arange(3))), torch.device("cpu"))
    assert received[0] is received[1] and received[0].is_leaf and received[2]._base is received[0]
    (received[0] * 2 + received[1] + received[2].t()).sum().backward()
    grads = boundary.input_grads(received)
    assert len(grads) == 1 and torch.equal(grads[0], torch.full((3, 4), 4.0))
    outs, seeds = boundary.grad_pairs((h, h, h.t(), torch.arange(3)), grads)
    assert len(outs) == 1 and outs[0] is h
