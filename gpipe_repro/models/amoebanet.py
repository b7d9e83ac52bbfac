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

Drop-path (on every op but ``none``, `amoebanet_ops.DropPath`) is ramped linearly by cell depth:
cell i of T = L + 4 cells drops with ``drop_path * (i + 1) / T`` (the reference's "v2" schedule; its
default "v1" ramps over training steps instead, which a caller can do by changing
:attr:`DropPath.drop_prob` between steps). The operations are in `amoebanet_ops.py`, the genotypes and
the cell in `amoebanet_cells.py`.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as functional
from torch import nn

from gpipe_repro.models.amoebanet_cells import GENOTYPES, AmoebaCell, CellGenotype
from gpipe_repro.models.amoebanet_ops import Norm

STEM_FILTERS = 32
AUX_LOSS_WEIGHT = 0.4


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
