"""A synthetic wide MLP: the smallest compute-bound model for runtime checks and benchmarks."""
from __future__ import annotations

from typing import Any


def synthetic_mlp(width: int, blocks: int, classes: int = 10, seed: int = 0) -> list[Any]:
    """`blocks` x (Linear(width, width), ReLU) as one layer each, the classifier on the last one.

    The first block starts with a LayerNorm (cheap) so that its Linear computes an input gradient
    like every other: otherwise the first cell's backward is lighter by one matmul and equal layer
    counts would not be balanced cells."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[Any] = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)]
    layers[0].insert(0, nn.LayerNorm(width))
    layers[-1].append(nn.Linear(width, classes))
    return layers
