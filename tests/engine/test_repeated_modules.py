"""One module object at several places of the model trains as plain PyTorch trains it: one set of
weights used at every place, its gradient the sum of the places' (ALBERT's shared blocks, an
activation module reused, a submodule held by two layers), at every cut, schedule and checkpoint
mode, each place in a cell of its own or several in one.

Each comparison runs 3 steps against :func:`tests.equivalence.reference_train` (plain PyTorch on the
same layers, the repeated objects kept: no engine code): every loss, then every parameter and
gradient under every name it has at every place.
"""
from __future__ import annotations

import copy
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


class _Counter(nn.Module):
    """Sets its buffer anew in its forward (a step counter): every place sees the last one's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n = self.n + 1
        return self.lin(x) * (1 + 0.1 * self.n)


@pytest.mark.parametrize("k", [1, 2])
def test_silent_a_module_at_two_places_setting_its_buffer_counted_at_each_place_alone(k: int) -> None:
    """Each place held its buffers in a dictionary of its own: a forward that sets its buffer anew
    (self.n = self.n + 1) counted per place (n 1, 2, 3 where plain PyTorch reads 2, 4, 6; outputs
    0.06-0.30 off), and the caller's module saw only the first place's count. The places share one
    dictionary of buffers, as one module does."""
    torch.manual_seed(0)
    counter = _Counter()
    model = nn.Sequential(counter, counter)
    plain = copy.deepcopy(model)                   # keeps the one module at two places
    pipe = GPipe(model, partitions=k, micro_batches=1, checkpoint="never", loss_fn=nn.MSELoss(),
                 optimizer=None)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(pipe(x), plain(x))
    assert float(counter.n) == float(plain[0].n) == 6.0


def test_places_holding_buffers_on_two_devices_are_refused() -> None:
    """One dictionary of buffers cannot hold a tensor on each device: refused, naming the module
    and what to do, before anything moves."""
    from gpipe_repro.engine.tied import refuse_buffers_across_devices, separate_places
    counter = _Counter()
    cells = [nn.Sequential(*places) for places in
             ([nn.Linear(4, 4), p] for p in separate_places([counter, counter]))]
    refuse_buffers_across_devices(cells, [torch.device("cpu")] * 2)
    with pytest.raises(ValueError, match="given at several places, and holds buffers \\(n\\).*own module"):
        refuse_buffers_across_devices(cells, [torch.device("cpu"), torch.device("meta")])


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
