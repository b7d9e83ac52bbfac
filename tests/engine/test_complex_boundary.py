"""A complex tensor crossing a cut (torch.fft) carries its gradient back, like a floating one; the
reference is plain PyTorch on the whole batch."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe


class FFT(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(x)


class Magnitude(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z.abs()


def train_across_a_complex_cut(schedule: str, runtime: str) -> bool:
    """Returns whether this process checked stage 0's gradient."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), FFT(), Magnitude(), nn.Linear(8, 8)]
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    ref = nn.Sequential(*copy.deepcopy(layers))
    nn.MSELoss()(ref(x), y).backward()
    pipe = GPipe(copy.deepcopy(layers), partitions=2, balance=[2, 2], micro_batches=2,
                 loss_fn=nn.MSELoss(), optimizer=None, schedule=schedule, runtime=runtime)
    pipe.train_step(x, y)
    if runtime == "distributed" and pipe.rank != 0:
        return False
    grad = pipe.cells[0][0].weight.grad
    assert grad is not None, "no gradient crossed the complex cut"
    torch.testing.assert_close(grad, ref[0].weight.grad, rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_a_complex_value_at_a_cut_carries_its_gradient(schedule: str) -> None:
    assert train_across_a_complex_cut(schedule, "local")


def test_the_distributed_runtime_sends_a_complex_value_and_its_gradient() -> None:
    from gpipe_repro.distributed import launch_local
    assert launch_local(train_across_a_complex_cut, 2, "1f1b", "distributed", timeout=60) == [True, False]
