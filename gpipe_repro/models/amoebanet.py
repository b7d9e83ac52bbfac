"""AmoebaNet(L, F) as a flat sequence of layers, B and D genotypes, as GPipe trained it.

Why a flat sequence: GPipe cuts a model between layers, and AmoebaNet's cells each read the two
previous cells' outputs. So every layer takes and returns the tuple ``(prev, cur)`` (``prev`` is the
output of the cell before ``cur``'s producer), and a cut may fall between any two cells. The first
layer (the stem convolution) takes the image; the head takes the tuple and returns logits.

The structure follows the reference AmoebaNet code of the same group (tensorflow/tpu
``models/official/amoeba_net``), which gives the paper's parameter counts exactly:

- stem: 3x3 stride-2 VALID conv to 32 filters + BN; then two reduction "stem cells" at F/4 and F/2;
- L normal cells in three stacks of filters F, 2F, 4F, a reduction cell before normal-cell
  indices int(L/3) and int(2L/3);
- head: ReLU, global average pool, dropout, fully connected;
- optional auxiliary head (the reference's, channels scaled by ``aux_scaling`` = 0.4) after the normal
  cell just before the second reduction. In training mode it appends its logits to the tuple, which
  then travels as ``(prev, cur, aux_logits)`` and the head returns ``(logits, aux_logits)``; in eval
  mode it does nothing and the head returns logits. :func:`amoebanet_loss` weights the aux loss 0.4.

Padding is "SAME"-style everywhere inside the cells (every stride-2 op maps a size n to ceil(n/2),
odd sizes included), so 28x28 and 32x32 inputs work as well as 224x224.

Drop-path (on every op but ``none``) draws its masks with ``torch.rand`` on the default generator, so
the engine's per-(layer, micro-batch) seeding replays them exactly on recompute. Its probability is
ramped linearly by cell depth: cell i of T = L + 4 cells drops with ``drop_path * (i + 1) / T`` (the
reference's "v2" schedule; its default "v1" ramps over training steps instead, which a caller can do
by changing :attr:`DropPath.drop_prob` between steps).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as functional
from torch import nn


@dataclass(frozen=True)
class CellGenotype:
    """One cell: five combinations, each adding ``ops[2i](states[inputs[2i]])`` and
    ``ops[2i+1](states[inputs[2i+1]])``; the output concatenates the states whose ``used`` flag is 0."""

    ops: tuple[str, ...]
    inputs: tuple[int, ...]
    used: tuple[int, ...]


@dataclass(frozen=True)
class Genotype:
    normal: CellGenotype
    reduction: CellGenotype


GENOTYPES: dict[str, Genotype] = {
    "B": Genotype(
        normal=CellGenotype(
            ops=("1x1", "max_pool_3x3", "none", "separable_3x3_2", "1x1",
                 "separable_3x3_2", "1x1", "none", "avg_pool_3x3", "1x1"),
            inputs=(1, 1, 1, 0, 1, 0, 2, 2, 1, 5),
            used=(0, 1, 1, 0, 0, 1, 0)),
        reduction=CellGenotype(
            ops=("max_pool_2x2", "max_pool_3x3", "none", "3x3", "dil_2_separable_5x5_2",
                 "max_pool_3x3", "none", "separable_3x3_2", "avg_pool_3x3", "1x1"),
            inputs=(0, 0, 2, 1, 2, 2, 3, 1, 4, 3),
            used=(1, 1, 1, 1, 1, 0, 0))),
    "D": Genotype(
        normal=CellGenotype(
            ops=("1x1", "max_pool_3x3", "none", "1x7_7x1", "1x1",
                 "1x7_7x1", "max_pool_3x3", "none", "avg_pool_3x3", "1x1"),
            inputs=(1, 1, 1, 0, 0, 0, 2, 2, 1, 5),
            used=(0, 1, 1, 0, 0, 1, 0)),
        reduction=CellGenotype(
            ops=("max_pool_2x2", "max_pool_3x3", "none", "3x3", "1x7_7x1",
                 "max_pool_3x3", "none", "max_pool_2x2", "avg_pool_3x3", "1x1"),
            inputs=(0, 0, 2, 1, 2, 2, 3, 1, 2, 3),
            used=(1, 1, 1, 1, 0, 0, 0))),
}

Norm = Callable[[int], nn.Module]
STEM_FILTERS = 32
AUX_LOSS_WEIGHT = 0.4


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------

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


def _conv(c_in: int, c_out: int, kernel: int | tuple[int, int], stride: int | tuple[int, int] = 1,
          groups: int = 1) -> nn.Conv2d:
    """A bias-free conv with SAME-style padding (odd kernels): size n -> ceil(n / stride)."""
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    return nn.Conv2d(c_in, c_out, (kh, kw), stride=stride, padding=(kh // 2, kw // 2),
                     groups=groups, bias=False)


def _relu_conv_bn(c_in: int, c_out: int, norm: Norm, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.ReLU(), _conv(c_in, c_out, 1, stride), norm(c_out))


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
            self.conv = _conv(c_in, c_out, 1)
        else:
            self.path1 = _conv(c_in, c_out // 2, 1)
            self.path2 = _conv(c_in, c_out // 2, 1)
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
            layers += [nn.ReLU(), _conv(src, src, kernel, stride if i == 0 else 1, groups=src),
                       _conv(src, c_out, 1), norm(c_out)]
        super().__init__(*layers)


class Bottleneck(nn.Sequential):
    """``3x3`` / ``1x7_7x1``: ReLU 1x1(F/4) BN, ReLU op(F/4) BN, ReLU 1x1(F) BN."""

    def __init__(self, op: str, c_in: int, c_out: int, stride: int, norm: Norm) -> None:
        mid = c_out // 4
        if mid < 1:        # the reference skips the bottleneck when F/4 would be empty
            super().__init__(nn.ReLU(), *self._core(op, c_in, c_out, stride, norm), norm(c_out))
            return
        super().__init__(nn.ReLU(), _conv(c_in, mid, 1), norm(mid),
                         nn.ReLU(), *self._core(op, mid, mid, stride, norm), norm(mid),
                         nn.ReLU(), _conv(mid, c_out, 1), norm(c_out))

    @staticmethod
    def _core(op: str, c_in: int, c_out: int, stride: int, norm: Norm) -> list[nn.Module]:
        if op == "3x3":
            return [_conv(c_in, c_out, 3, stride)]
        if op == "1x7_7x1":
            return [_conv(c_in, c_out, (1, 7), (1, stride)), norm(c_out), nn.ReLU(),
                    _conv(c_out, c_out, (7, 1), (stride, 1))]
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
        self.project = (nn.Sequential(_conv(c_in, c_out, 1), norm(c_out))
                        if c_in != c_out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.pool(x))


def make_op(op: str, c_in: int, c_out: int, stride: int, norm: Norm) -> nn.Module:
    """The module for one genotype op name (the naming of the reference code)."""
    if op == "none":
        if stride == 1 and c_in == c_out:
            return nn.Identity()
        return _relu_conv_bn(c_in, c_out, norm, stride)
    if op == "1x1":
        return _relu_conv_bn(c_in, c_out, norm, stride)
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


# --------------------------------------------------------------------------------------------
# Layers of the flat sequence
# --------------------------------------------------------------------------------------------

class Stem(nn.Module):
    """Image -> 3x3 stride-2 VALID conv (32 filters) + BN."""

    def __init__(self, in_channels: int, norm: Norm, filters: int = STEM_FILTERS) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, filters, 3, stride=2, padding=0, bias=False)
        self.bn = norm(filters)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if image.dim() != 4:
            raise ValueError(f"AmoebaNet expects images of shape (N, C, H, W), got {tuple(image.shape)}")
        return self.bn(self.conv(image))


class AmoebaCell(nn.Module):
    """A normal or reduction cell: ``(prev, cur, *extras) -> (cur, out, *extras)``.

    The very first cell receives the stem's tensor alone; as in the reference, its `prev` is then
    `cur` itself, unadjusted.
    """

    def __init__(self, genotype: CellGenotype, c_prev: int | None, c_cur: int, channels: int,
                 prev_is_larger: bool, reduction: bool, drop_prob: float, norm: Norm) -> None:
        super().__init__()
        self.genotype = genotype
        self.reduction = reduction
        self.preprocess_cur = _relu_conv_bn(c_cur, channels, norm)
        if c_prev is None:
            self.preprocess_prev: nn.Module = nn.Identity()
            c_state1 = c_cur
        elif prev_is_larger:
            self.preprocess_prev = nn.Sequential(nn.ReLU(), FactorizedReduction(c_prev, channels, norm))
            c_state1 = channels
        elif c_prev != channels:
            self.preprocess_prev = _relu_conv_bn(c_prev, channels, norm)
            c_state1 = channels
        else:
            self.preprocess_prev = nn.Identity()
            c_state1 = channels

        stride = 2 if reduction else 1
        state_channels = [channels, c_state1]
        state_reduced = [False, False]          # is the state at the cell's output resolution?
        self.ops = nn.ModuleList()
        for i, (op, src) in enumerate(zip(genotype.ops, genotype.inputs)):
            op_stride = stride if src < 2 else 1
            branch = make_op(op, state_channels[src], channels, op_stride, norm)
            if op != "none":
                branch = nn.Sequential(branch, DropPath(drop_prob))
            self.ops.append(branch)
            if i % 2 == 1:
                state_channels.append(channels)
                state_reduced.append(True)
        if not reduction:
            state_reduced = [True] * len(state_reduced)

        # Unused states of a different size or width are reduced to the final state's shape.
        self.fit_outputs = nn.ModuleDict()
        for idx, used in enumerate(genotype.used):
            if used:
                continue
            if not state_reduced[idx] or state_channels[idx] != channels:
                self.fit_outputs[str(idx)] = FactorizedReduction(
                    state_channels[idx], channels, norm, stride=1 if state_reduced[idx] else 2)
        self.out_channels = channels * sum(1 for u in genotype.used if not u)

    def forward(self, x: torch.Tensor | tuple[Any, ...]) -> tuple[Any, ...]:
        if isinstance(x, torch.Tensor):
            prev, cur, extras = x, x, ()
        else:
            prev, cur, *rest = x
            extras = tuple(rest)
        states = [self.preprocess_cur(cur), self.preprocess_prev(prev)]
        inputs = self.genotype.inputs
        for i in range(0, len(self.ops), 2):
            states.append(self.ops[i](states[inputs[i]]) + self.ops[i + 1](states[inputs[i + 1]]))
        outs = [self.fit_outputs[str(i)](h) if str(i) in self.fit_outputs else h
                for i, (h, used) in enumerate(zip(states, self.genotype.used)) if not used]
        return (cur, torch.cat(outs, dim=1), *extras)


class AuxHead(nn.Module):
    """The reference's auxiliary classifier: appends aux logits to the tuple in training mode.

    ReLU, 5x5 stride-3 VALID average pool, 1x1 conv + BN + ReLU, a conv over the whole remaining map
    + BN + ReLU, fully connected. The map size depends on the image size, hence `spatial`.
    """

    def __init__(self, c_in: int, num_classes: int, spatial: int, norm: Norm,
                 scaling: float = 0.4) -> None:
        super().__init__()
        self.spatial = spatial
        kernel = min(5, spatial)
        pooled = (spatial - kernel) // 3 + 1
        c1, c2 = int(128 * scaling), int(768 * scaling)
        self.net = nn.Sequential(
            nn.ReLU(), nn.AvgPool2d(kernel, stride=3),
            nn.Conv2d(c_in, c1, 1, bias=False), norm(c1), nn.ReLU(),
            nn.Conv2d(c1, c2, pooled, bias=False), norm(c2), nn.ReLU(),
            nn.Flatten(), nn.Linear(c2, num_classes))

    def forward(self, x: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self.training:
            return x
        cur = x[1]
        if cur.shape[-1] != self.spatial or cur.shape[-2] != self.spatial:
            raise ValueError(f"the auxiliary head was built for a {self.spatial}x{self.spatial} map "
                             f"(image_size passed to amoebanet()), got {tuple(cur.shape[-2:])}; "
                             "pass the image_size you train with")
        return (*x, self.net(cur))


class Head(nn.Module):
    """ReLU, global average pool, dropout, fully connected. Returns logits, or (logits, aux_logits)."""

    def __init__(self, c_in: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: tuple[Any, ...]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        cur = x[1]
        pooled = functional.relu(cur).mean(dim=(2, 3))
        logits = self.fc(self.dropout(pooled))
        if len(x) > 2:
            return logits, x[2]
        return logits


# --------------------------------------------------------------------------------------------
# The builder
# --------------------------------------------------------------------------------------------

def reduction_indices(num_cells: int, num_reductions: int = 2) -> list[int]:
    """Normal-cell indices before which a reduction cell goes (the reference's rule)."""
    return [int(k / (num_reductions + 1) * num_cells) for k in range(1, num_reductions + 1)]


def _after_stride2(size: int) -> int:
    return math.ceil(size / 2)


def amoebanet(L: int, F: int, genotype: str = "D", num_classes: int = 1001, *,
              in_channels: int = 3, dropout: float = 0.0, drop_path: float = 0.0,
              aux_head: bool = False, image_size: int = 224, aux_scaling: float = 0.4,
              bn_momentum: float = 0.1, bn_eps: float = 1e-3) -> nn.Sequential:
    """AmoebaNet(L, F) as a flat ``nn.Sequential`` (see the module docstring for the conventions).

    Args:
        L: normal cells over the three stacks (L/3 each); at least 3.
        F: filters of the first stack (2F and 4F after the reductions); a multiple of 4.
        genotype: "B" or "D".
        dropout: dropout probability before the classifier (the reference trains with 0.5).
        drop_path: final drop-path probability, ramped by cell depth (the reference uses 0.3).
        aux_head: add the auxiliary classifier; it needs `image_size` (the training resolution).
        bn_momentum: PyTorch BatchNorm momentum (the reference's decay 0.9997 is momentum 0.0003).
    """
    if genotype.upper() not in GENOTYPES:
        raise ValueError(f"unknown AmoebaNet genotype {genotype!r}; choose one of {sorted(GENOTYPES)}")
    if L < 3:
        raise ValueError(f"AmoebaNet needs L >= 3 normal cells (one per stack), got L={L}")
    if F < 4 or F % 4:
        raise ValueError(f"AmoebaNet needs F divisible by 4 (stem cells use F/4 and F/2), got F={F}")
    geno = GENOTYPES[genotype.upper()]

    def norm(c: int) -> nn.Module:
        return nn.BatchNorm2d(c, eps=bn_eps, momentum=bn_momentum)

    layers: OrderedDict[str, nn.Module] = OrderedDict()
    layers["stem"] = Stem(in_channels, norm)
    total_cells = L + 4
    cell_num = 0
    spatial = (image_size - 3) // 2 + 1
    c_prev: int | None = None
    c_cur = STEM_FILTERS
    last_was_reduction = False

    def add_cell(name: str, spec: CellGenotype, channels: int, reduction: bool) -> None:
        nonlocal cell_num, c_prev, c_cur, last_was_reduction, spatial
        drop = drop_path * (cell_num + 1) / total_cells
        cell = AmoebaCell(spec, c_prev, c_cur, channels, prev_is_larger=last_was_reduction,
                          reduction=reduction, drop_prob=drop, norm=norm)
        layers[name] = cell
        c_prev, c_cur = c_cur, cell.out_channels
        last_was_reduction = reduction
        if reduction:
            spatial = _after_stride2(spatial)
        cell_num += 1

    for i in range(2):
        add_cell(f"stem_cell_{i}", geno.reduction, int(F * 0.25 * 2 ** i), reduction=True)

    reductions = reduction_indices(L)
    scaling = 1
    for i in range(L):
        if i in reductions:
            scaling *= 2
            add_cell(f"reduction_cell_{reductions.index(i)}", geno.reduction, F * scaling, True)
        add_cell(f"cell_{i}", geno.normal, F * scaling, reduction=False)
        if aux_head and i == reductions[1] - 1:
            layers["aux_head"] = AuxHead(c_cur, num_classes, spatial, norm, aux_scaling)
    layers["head"] = Head(c_cur, num_classes, dropout)

    model = nn.Sequential(layers)
    _init_weights(model)
    return model


def _init_weights(model: nn.Module) -> None:
    """The reference's variance scaling (fan-out, factor 2) for convs; PyTorch defaults elsewhere.
    Skipped on the meta device, where there are no values."""
    if any(p.is_meta for p in model.parameters()):
        return
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


def amoebanet_loss(output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], target: torch.Tensor,
                   label_smoothing: float = 0.0, aux_weight: float = AUX_LOSS_WEIGHT) -> torch.Tensor:
    """Cross-entropy of the logits, plus `aux_weight` x that of the aux logits when present."""
    if isinstance(output, tuple):
        logits, aux = output
        return (functional.cross_entropy(logits, target, label_smoothing=label_smoothing)
                + aux_weight * functional.cross_entropy(aux, target, label_smoothing=label_smoothing))
    return functional.cross_entropy(output, target, label_smoothing=label_smoothing)


def main_logits(output: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The classifier's logits from a head output with or without aux logits."""
    return output[0] if isinstance(output, tuple) else output
