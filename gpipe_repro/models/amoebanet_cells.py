"""AmoebaNet's cells: the B and D genotypes, and :class:`AmoebaCell`, one normal or reduction cell built
from a genotype with the operations of `amoebanet_ops.py`.

A cell reads the two previous cells' outputs, so in the flat layer sequence (`amoebanet.py`) it takes
and returns the tuple ``(prev, cur, *extras)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe_repro.models.amoebanet_ops import DropPath, FactorizedReduction, Norm, make_op, relu_conv_bn


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
        self.preprocess_cur = relu_conv_bn(c_cur, channels, norm)
        if c_prev is None:
            self.preprocess_prev: nn.Module = nn.Identity()
            c_state1 = c_cur
        elif prev_is_larger:
            self.preprocess_prev = nn.Sequential(nn.ReLU(), FactorizedReduction(c_prev, channels, norm))
            c_state1 = channels
        elif c_prev != channels:
            self.preprocess_prev = relu_conv_bn(c_prev, channels, norm)
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
