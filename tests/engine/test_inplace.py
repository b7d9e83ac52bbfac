"""In-place layers anywhere: every cut, every checkpoint mode, every cost measurement, and the
caller's tensors are never modified by the engine.

Models are torchvision-style stacks flattened to layers (written here: torchvision is not a
dependency): a ResNet (stem, BasicBlocks, head) and a VGG stack, with ``ReLU(inplace=True)`` and
BatchNorm, cut by the default partitioner (``cost="params"``) at K = 2..4.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.engine.layer_costs import layer_costs
from tests.equivalence import adam, assert_same_training, sgd_momentum


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock, with its ReLU(inplace=True) applied after the add."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def resnet() -> list[nn.Module]:
    """A small torchvision-style ResNet, flattened: stem layers, blocks, head layers."""
    torch.manual_seed(5)
    return [nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), BasicBlock(8, 8), BasicBlock(8, 16, 2), BasicBlock(16, 16),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2, inplace=True), nn.Linear(16, 5)]


def vgg() -> list[nn.Module]:
    """A small torchvision-style VGG (features + classifier), flattened: Conv, BN, ReLU(inplace)."""
    torch.manual_seed(6)
    feats: list[nn.Module] = []
    cin = 3
    for cout in (8, 8, "M", 16, 16, "M"):
        if cout == "M":
            feats.append(nn.MaxPool2d(2))
            continue
        assert isinstance(cout, int)
        feats += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
        cin = cout
    return feats + [nn.Flatten(), nn.Linear(16 * 2 * 2, 16), nn.ReLU(inplace=True),
                    nn.Dropout(0.3), nn.Linear(16, 5)]


def images(seed: int, n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


@pytest.mark.parametrize("build", [resnet, vgg])
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_inplace_relu_at_cut_torchvision_style_default_partitioner(build, mode: str, k: int) -> None:
    batches = [images(s) for s in range(3)]
    pipe = assert_same_training(build(), None, None, nn.CrossEntropyLoss(), partitions=k, micro_batches=3,
                                checkpoint=mode, batches=batches, optimizer=(sgd_momentum, adam)[k % 2],
                                atol=1e-5)
    layers = build()
    cut_before_inplace = [isinstance(layers[sum(pipe.balance[:s])], (nn.ReLU, nn.Dropout, BasicBlock))
                          for s in range(1, k)]
    if build is vgg:  # the partitioner cuts right before an in-place layer: the finding's case
        assert any(cut_before_inplace) or k == 4, pipe.balance


def test_inplace_relu_at_cut_the_partitioner_really_cuts_there() -> None:
    """The plain Conv / ReLU(inplace) stack of the finding: params-balanced cuts land before ReLUs."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True))]
    for k in (2, 3, 4):
        pipe = GPipe(copy.deepcopy(layers), partitions=k, micro_batches=2, optimizer=None)
        firsts = [pipe.cells[s][0] for s in range(1, k)]
        assert any(isinstance(f, nn.ReLU) for f in firsts), pipe.balance
        x = torch.randn(4, 4, 5, 5)
        assert_same_training(copy.deepcopy(layers), x, torch.randn(4, 4, 5, 5), nn.MSELoss(),
                             partitions=k, micro_batches=2, checkpoint="except_last", balance=pipe.balance)


class Double(nn.Module):
    """``x.mul_(2)``: an in-place first layer that is not a torch.nn layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_inplace_dropout_first_layer_stage0_gradients(mode: str) -> None:
    torch.manual_seed(0)
    layers = [nn.Dropout(0.2, inplace=True), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)]
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    assert_same_training(layers, x, y, nn.CrossEntropyLoss(), partitions=2, micro_batches=2, checkpoint=mode,
                         steps=3)


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_inplace_mul_first_layer_gradient_and_caller_input_untouched(mode: str) -> None:
    torch.manual_seed(0)
    layers = [Double(), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)]
    x, y = torch.randn(10, 6), torch.randn(10, 1)
    before = x.clone()
    assert_same_training(layers, x, y, nn.MSELoss(), partitions=2, micro_batches=2, checkpoint=mode, steps=2)
    assert torch.equal(x, before), "the engine modified the caller's input"
    pipe = GPipe(copy.deepcopy(layers), partitions=2, micro_batches=2, optimizer=None).eval()
    pipe(x)
    assert torch.equal(x, before), "forward() modified the caller's input"


def test_inplace_probe_costs_nothing_when_no_cell_modifies_its_input() -> None:
    torch.manual_seed(0)
    plain = GPipe([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)], partitions=2, micro_batches=2,
                  balance=[1, 2], loss_fn=nn.MSELoss(), optimizer=None)
    inplace = GPipe([nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4)], partitions=2, micro_batches=2,
                    balance=[1, 2], loss_fn=nn.MSELoss(), optimizer=None)
    for pipe in (plain, inplace):
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4))
    # stage 0 always copies the caller's batch (nothing to learn there); later cells learn
    assert [e.input_guard.learned for e in plain.executors] == [{}, {(True, 0): False}]
    assert [e.input_guard.learned for e in inplace.executors] == [{}, {(True, 0): True}]


def test_a_first_layer_that_starts_working_in_place_late_never_changes_the_callers_batch() -> None:
    torch.manual_seed(0)
    pipe = GPipe([LateInplace(after=3), nn.Linear(4, 4), nn.Linear(4, 1)], partitions=2, balance=[2, 1],
                 micro_batches=2, loss_fn=nn.MSELoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    before = x.clone()
    for _ in range(3):
        pipe.train_step(x, y)
    assert torch.equal(x, before)


class LateInplace(nn.Module):
    """Modifies its input in place only from its `after`-th call on (data-dependent in-placeness)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.calls = after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.mul_(2) if self.calls > self.after else x * 2


def test_inplace_that_starts_late_fails_the_step_before_any_update() -> None:
    torch.manual_seed(0)
    late = LateInplace(after=4)
    pipe = GPipe([nn.Linear(4, 4), late, nn.Linear(4, 1)], partitions=2, balance=[1, 2], micro_batches=2,
                 checkpoint="always", loss_fn=nn.MSELoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    pipe.train_step(x, y)          # calls 1..2 (forward), 3..4 (recompute): the probe saw no change
    before = copy.deepcopy(pipe.state_dict())
    with pytest.raises(RuntimeError,
                       match="modified its input in place.*no cell was updated.*run the step again"):
        pipe.train_step(x, y)
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert pipe.step == 1
    pipe.train_step(x, y)          # now copied: works
    assert pipe.step == 2


@pytest.mark.parametrize("cost", ["flops", "time", "activations"])
def test_inplace_cost_measurement(cost: str) -> None:
    layers = vgg()
    x, _ = images(0)
    before = x.clone()
    costs = layer_costs(layers, cost, x, repeats=1)
    assert torch.equal(x, before), "measuring costs modified the sample"
    assert len(costs) == len(layers) and all(c >= 0 for c in costs)
    if cost != "time":   # deterministic: equal to the same stack without in-place layers
        plain = copy.deepcopy(layers)
        for layer in plain:
            if isinstance(layer, (nn.ReLU, nn.Dropout)):
                layer.inplace = False
        assert costs == layer_costs(plain, cost, x)
    pipe = GPipe(vgg(), partitions=3, micro_batches=2, cost=cost, sample=x, loss_fn=nn.CrossEntropyLoss(),
                 optimizer=None)
    assert torch.equal(x, before) and len(pipe.balance) == 3
