"""One module object at several places of the model trains as plain PyTorch trains it: one set of
weights used at every place, its gradient the sum of the places' (ALBERT's shared blocks, an
activation module reused, a submodule held by two layers), at every cut, schedule and checkpoint
mode, each place in a cell of its own or several in one.

Each comparison runs 3 steps against :func:`tests.equivalence.reference_train` (plain PyTorch on the
same layers, the repeated objects kept: no engine code): every loss, then every parameter and
gradient under every name it has at every place.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe
from tests.equivalence import adam, assert_same_training, sgd_momentum


def shared_blocks() -> list[nn.Module]:
    """ALBERT's way: one block object at three places."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    return [nn.Linear(6, 8), block, block, block, nn.Linear(8, 3)]


def reused_activation() -> list[nn.Module]:
    torch.manual_seed(1)
    act = nn.GELU()
    return [nn.Linear(6, 8), act, nn.Linear(8, 8), act, nn.Linear(8, 3)]


def shared_submodule() -> list[nn.Module]:
    """Two different layers holding one Linear."""
    torch.manual_seed(2)
    shared = nn.Linear(8, 8)
    return [nn.Linear(6, 8), nn.Sequential(shared, nn.ReLU()), nn.Sequential(nn.Tanh(), shared),
            nn.Linear(8, 3)]


MODELS: dict[str, Callable[[], list[nn.Module]]] = {
    "shared-blocks": shared_blocks, "reused-activation": reused_activation,
    "shared-submodule": shared_submodule}
# (schedule, partitions, checkpoint)
CONFIGS = [("gpipe", 1, "never"), ("gpipe", 2, "always"), ("gpipe", 3, "except_last"),
           ("1f1b", 2, "except_last"), ("zb-h1", 3, "never"), ("zb-h1", 2, "always"),
           ("interleaved", 2, "never"), ("zb-v", 2, "always"), ("dualpipe-v", 2, "never")]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("schedule,k,checkpoint", CONFIGS, ids=[f"{s}-K{k}-{c}" for s, k, c in CONFIGS])
def test_one_module_at_several_places_trains_like_plain_pytorch(model: str, schedule: str, k: int,
                                                                checkpoint: str) -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    assert_same_training(MODELS[model](), x, y, nn.MSELoss(), partitions=k, micro_batches=4,
                         checkpoint=checkpoint, steps=3, optimizer=adam, schedule=schedule)


def test_the_callers_shared_block_holds_the_trained_weights() -> None:
    model = nn.Sequential(*shared_blocks())
    plain = nn.Sequential(*shared_blocks())
    pipe = GPipe(model, partitions=3, micro_batches=2, loss_fn=nn.MSELoss(), optimizer=sgd_momentum)
    opt = sgd_momentum(plain.parameters())
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    for _ in range(2):
        pipe.train_step(x, y)
        opt.zero_grad()
        nn.MSELoss()(plain(x), y).backward()
        opt.step()
    assert pipe.balance == [2, 1, 2]       # the block's three places in three cells
    for (name, p), q in zip(model.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(pipe(x), plain(x))


def test_a_change_to_a_shared_module_reaches_every_place() -> None:
    block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    model = nn.Sequential(nn.Linear(6, 8), block, block, block, nn.Linear(8, 3))
    pipe = GPipe(model, partitions=3, micro_batches=2, loss_fn=nn.MSELoss(), optimizer=None)
    x = torch.randn(8, 6)
    model.eval()
    torch.testing.assert_close(pipe(x), model(x))       # every place's dropout off
    block[1].p = 0.0
    model.train()
    torch.testing.assert_close(pipe(x), model(x))
    assert [m.p for cell in pipe.cells for m in cell.modules() if isinstance(m, nn.Dropout)] == [0.0] * 3


def test_one_batchnorm_at_two_places_is_still_refused() -> None:
    bn = nn.BatchNorm1d(8)
    with pytest.raises(ValueError, match="layer 3 .* is the same BatchNorm module as layer 1"):
        GPipe([nn.Linear(6, 8), bn, nn.Linear(8, 8), bn], partitions=2, micro_batches=2, loss_fn=nn.MSELoss())


def test_each_place_moves_its_own_buffers() -> None:
    """A module with a buffer at places in two cells: moving one cell (to its device; here to
    float64) moves that place's buffer, not the other place's."""
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("scale", torch.full((8,), 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    block = Scaled()
    model = [nn.Linear(6, 8), block, block, nn.Linear(8, 3)]
    pipe = GPipe(model, partitions=2, micro_batches=2, balance=[2, 2], loss_fn=nn.MSELoss(), optimizer=None)
    assert pipe.cells[1][0].scale is block.scale        # one tensor until a cell moves
    pipe.cells[1].to(torch.float64)
    assert block.scale.dtype == torch.float32 and pipe.cells[0][1].scale.dtype == torch.float32
    assert pipe.cells[1][0].scale.dtype == torch.float64


class _SetsItsScale(nn.Module):
    """Sets its buffer in its forward, alike each time (as LongRoPE sets its inv_freq)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = torch.full((8,), 0.5)
        return self.lin(x) * self.scale


def test_a_module_setting_its_buffer_in_its_forward_at_several_places_trains_like_plain_pytorch() -> None:
    torch.manual_seed(4)
    block = _SetsItsScale()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    assert_same_training([nn.Linear(6, 8), block, block, nn.Linear(8, 3)], x, y, nn.MSELoss(),
                         partitions=2, micro_batches=2, checkpoint="always", steps=3,
                         optimizer=sgd_momentum, balance=[2, 2])
