"""The weight half's direct kernels: a convolution's, a norm's or a linear layer's parameter
gradients from the node's own kernel equal one whole backward's; groups they cannot take (a
parameter used elsewhere too, a hooked parameter) still go through autograd."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro.engine import weight_kernels
from gpipe_repro.engine.backward_split import split_backward_input


def _split_against_whole(model: nn.Module, x: torch.Tensor) -> int:
    """Split backward of `model` on `x` against a whole backward of a copy; how many groups ran by
    a kernel."""
    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    ref(xr).square().sum().backward()
    xs = x.clone().requires_grad_()
    out = model(xs).square().sum()
    ran = []
    real = weight_kernels._direct

    def counted(group: dict[str, Any]) -> bool:
        ran.append(real(group))
        return ran[-1]
    weight_kernels._direct = counted
    try:
        split_backward_input([out], [torch.ones_like(out)], [xs], list(model.parameters()))()
    finally:
        weight_kernels._direct = real
    torch.testing.assert_close(xs.grad, xr.grad)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    return sum(ran)


@pytest.mark.parametrize("bias", [False, True])
def test_convolution_and_batchnorm_gradients_equal_a_whole_backwards(bias: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=bias), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, stride=2, groups=2, bias=bias), nn.BatchNorm2d(4))
    assert _split_against_whole(model, torch.randn(2, 3, 8, 8)) == 4


def test_batchnorm_in_eval_mode_uses_the_running_statistics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1)).eval()
    assert _split_against_whole(model, torch.randn(2, 3, 4, 4)) == 3


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 4)])
def test_linear_and_layernorm_gradients_equal_a_whole_backwards(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 2, bias=False))
    assert _split_against_whole(model, torch.randn(*shape)) == 3
    assert all(p.grad is not None and p.grad.is_contiguous() for p in model.parameters())


class _SharedWeight(nn.Module):
    """One weight used by two products: its gradient path meets the input's at two nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w) @ self.w


def test_a_weight_used_at_two_nodes_goes_through_autograd() -> None:
    torch.manual_seed(0)
    assert _split_against_whole(_SharedWeight(), torch.randn(3, 4)) == 0


def test_a_hooked_parameter_goes_through_autograd_and_its_hook_runs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Conv2d(4, 2, 1))
    seen = []
    model[0].weight.register_hook(lambda g: seen.append(g.shape))
    assert _split_against_whole(model, torch.randn(2, 3, 4, 4)) == 1
    assert seen == [torch.Size([4, 3, 1, 1])]


def test_a_weight_used_as_mat2_got_a_transposed_gradient() -> None:
    """GPT-2's Conv1D multiplies by its weight itself (addmm's mat2), not by a transpose: the weight
    kernel handed it a transposed (non-contiguous) gradient where plain autograd's is contiguous,
    and adding into it later warned that the gradient layout contract was broken. The first
    gradient is now made in the parameter's layout."""
    class Conv1D(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.zeros(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.addmm(self.bias, x, self.weight)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Conv1D(), nn.Tanh(), nn.Linear(6, 2))
    assert _split_against_whole(model, torch.randn(3, 4)) >= 1
    for p in model.parameters():
        assert p.grad is not None and p.grad.stride() == p.stride()
