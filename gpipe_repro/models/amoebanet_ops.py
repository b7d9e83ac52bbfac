"""AmoebaNet's operations: the modules a genotype's op names stand for (:func:`make_op`), and drop-path.

The names follow the reference AmoebaNet code (tensorflow/tpu ``models/official/amoeba_net``):
``none``, ``1x1``, ``3x3`` / ``1x7_7x1`` (bottlenecks), ``separable_KxK_N``, ``max_pool_KxK`` /
``avg_pool_KxK``. Padding is "SAME"-style everywhere (every stride-2 op maps a size n to ceil(n/2),
odd sizes included), so 28x28 and 32x32 inputs work as well as 224x224.

Drop-path draws its masks with ``torch.rand`` on the default generator, so the engine's
per-(layer, micro-batch) seeding replays them exactly on recompute.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as functional
from torch import nn

Norm = Callable[[int], nn.Module]


class DropPath(nn.Module):
    """Zero a whole example's branch with probability `drop_prob` (training only), rescaling the rest.

    The mask comes from ``torch.rand`` on the default generator: seeding that generator replays it.
    """

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob <= 0.0:
            return x
        keep = 1.0 - self.drop_prob
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        mask = (torch.rand(shape, dtype=x.dtype, device=x.device) < keep).to(x.dtype)
        return x * (mask / keep)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.4f}"


def same_conv(c_in: int, c_out: int, kernel: int | tuple[int, int], stride: int | tuple[int, int] = 1,
              groups: int = 1) -> nn.Conv2d:
    """A bias-free conv with SAME-style padding (odd kernels): size n -> ceil(n / stride)."""
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    return nn.Conv2d(c_in, c_out, (kh, kw), stride=stride, padding=(kh // 2, kw // 2),
                     groups=groups, bias=False)


def relu_conv_bn(c_in: int, c_out: int, norm: Norm, stride: int = 1) -> nn.Sequential:
    """ReLU, a 1x1 conv (stride `stride`), norm: the reference's channel (and size) adjustment."""
    return nn.Sequential(nn.ReLU(), same_conv(c_in, c_out, 1, stride), norm(c_out))


class FactorizedReduction(nn.Module):
    """Halve the resolution without losing pixels: two stride-2 1x1 convs on offset grids, concat, BN.

    With ``stride=1`` it is a plain 1x1 conv + BN (the reference's channel-only adjustment).
    """

    def __init__(self, c_in: int, c_out: int, norm: Norm, stride: int = 2) -> None:
        super().__init__()
        if stride == 2 and c_out % 2:
            raise ValueError(f"factorized reduction needs an even number of filters, got {c_out}; "
                             "use F divisible by 4")
        self.stride = stride
        if stride == 1:
            self.conv = same_conv(c_in, c_out, 1)
        else:
            self.path1 = same_conv(c_in, c_out // 2, 1)
            self.path2 = same_conv(c_in, c_out // 2, 1)
        self.bn = norm(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            return self.bn(self.conv(x))
        a = self.path1(x[:, :, ::2, ::2])
        shifted = functional.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]   # the grid offset by one pixel
        b = self.path2(shifted[:, :, ::2, ::2])
        return self.bn(torch.cat([a, b], dim=1))


class StackedSeparable(nn.Sequential):
    """``separable_KxK_N``: N x (ReLU, depthwise KxK + pointwise 1x1, BN); stride on the first."""

    def __init__(self, c_in: int, c_out: int, kernel: int, repeats: int, stride: int,
                 norm: Norm) -> None:
        layers: list[nn.Module] = []
        for i in range(repeats):
            src = c_in if i == 0 else c_out
            layers += [nn.ReLU(), same_conv(src, src, kernel, stride if i == 0 else 1, groups=src),
                       same_conv(src, c_out, 1), norm(c_out)]
        super().__init__(*layers)


class Bottleneck(nn.Sequential):
    """``3x3`` / ``1x7_7x1``: ReLU 1x1(F/4) BN, ReLU op(F/4) BN, ReLU 1x1(F) BN."""

    def __init__(self, op: str, c_in: int, c_out: int, stride: int, norm: Norm) -> None:
        mid = c_out // 4
        if mid < 1:        # the reference skips the bottleneck when F/4 would be empty
            super().__init__(nn.ReLU(), *self._core(op, c_in, c_out, stride, norm), norm(c_out))
            return
        super().__init__(nn.ReLU(), same_conv(c_in, mid, 1), norm(mid),
                         nn.ReLU(), *self._core(op, mid, mid, stride, norm), norm(mid),
                         nn.ReLU(), same_conv(mid, c_out, 1), norm(c_out))

    @staticmethod
    def _core(op: str, c_in: int, c_out: int, stride: int, norm: Norm) -> list[nn.Module]:
        if op == "3x3":
            return [same_conv(c_in, c_out, 3, stride)]
        if op == "1x7_7x1":
            return [same_conv(c_in, c_out, (1, 7), (1, stride)), norm(c_out), nn.ReLU(),
                    same_conv(c_out, c_out, (7, 1), (stride, 1))]
        raise ValueError(f"unknown bottleneck op {op!r}")


class Pool(nn.Module):
    """``max_pool_KxK`` / ``avg_pool_KxK`` with SAME-style sizes, then 1x1 conv + BN if channels differ."""

    def __init__(self, kind: str, kernel: int, c_in: int, c_out: int, stride: int,
                 norm: Norm) -> None:
        super().__init__()
        if kernel % 2 == 0 and stride != 2:
            raise ValueError(f"{kind}_pool_{kernel}x{kernel} is only supported with stride 2")
        if kind == "max":
            # An even kernel with stride 2 and ceil_mode gives ceil(n/2), like TF's SAME padding.
            self.pool: nn.Module = nn.MaxPool2d(kernel, stride, padding=(kernel - 1) // 2,
                                                ceil_mode=kernel % 2 == 0)
        elif kind == "avg":
            if kernel % 2 == 0:
                raise ValueError("even-sized average pooling is not supported")
            self.pool = nn.AvgPool2d(kernel, stride, padding=kernel // 2, count_include_pad=False)
        else:
            raise ValueError(f"unknown pooling {kind!r}")
        self.project = (nn.Sequential(same_conv(c_in, c_out, 1), norm(c_out))
                        if c_in != c_out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.pool(x))


def make_op(op: str, c_in: int, c_out: int, stride: int, norm: Norm) -> nn.Module:
    """The module for one genotype op name (the naming of the reference code)."""
    if op == "none":
        if stride == 1 and c_in == c_out:
            return nn.Identity()
        return relu_conv_bn(c_in, c_out, norm, stride)
    if op == "1x1":
        return relu_conv_bn(c_in, c_out, norm, stride)
    if op in ("3x3", "1x7_7x1"):
        return Bottleneck(op, c_in, c_out, stride, norm)
    if "separable" in op:
        # 'separable_3x3_2' -> kernel 3, 2 repeats. 'dil_2_separable_5x5_2': the reference parses
        # it the same way and ignores the dilation; so do we (no effect on parameters).
        kernel = int(op.split("x")[1].split("_")[0])
        repeats = int(op.rsplit("_", 1)[1])
        return StackedSeparable(c_in, c_out, kernel, repeats, stride, norm)
    if "pool" in op:
        kind, _, size = op.split("_")
        return Pool(kind, int(size.split("x")[0]), c_in, c_out, stride, norm)
    raise ValueError(f"unknown AmoebaNet op {op!r}")
