"""The models and sizes `make bench-compile` measures (experiments/bench_compile.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class SequenceMean(nn.Module):
    """(batch, sequence, features) -> (batch, features): the mean over the sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


@dataclass(frozen=True)
class Sizes:
    """The models' and batches' sizes (the default run, or the tiny one)."""

    mlp_width: int = 256
    mlp_depth: int = 2
    mlp_batch: int = 64
    model_dim: int = 64
    heads: int = 4
    blocks: int = 2
    sequence: int = 16
    transformer_batch: int = 16
    channels: int = 16
    image: int = 16
    micro_batches: int = 32
    images_per_micro_batch: int = 8
    sync_width: int = 64
    sync_batch: int = 32


TINY = Sizes(mlp_width=8, mlp_depth=1, mlp_batch=8, model_dim=8, heads=2, blocks=1, sequence=4,
             transformer_batch=4, channels=2, image=4, micro_batches=4, images_per_micro_batch=2,
             sync_width=8, sync_batch=8)


def transformer_blocks(dim: int, heads: int, blocks: int) -> list[nn.Module]:
    """`blocks` post-norm Transformer encoder blocks (no dropout), a mean over the sequence and a
    Linear to 10 classes, seeded."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
                               for _ in range(blocks)]
    return layers + [SequenceMean(), nn.Linear(dim, 10)]


def conv_net(channels: int) -> list[nn.Module]:
    """Three layers: two of a 3x3 convolution and a ReLU, then a global average pool and a Linear to
    10 classes, seeded."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))]
