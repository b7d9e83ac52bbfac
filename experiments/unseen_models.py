"""Models written for checking the cost model, which no calibration constant was fitted to: a
pre-norm residual GELU MLP whose hidden width alternates wide and narrow, a convolutional pyramid
(channels double as the resolution halves) and a stack of pre-norm Transformer encoder blocks.

Each is a factory for ``gpipe-repro throughput --model experiments.unseen_models:<name>``."""
from __future__ import annotations

from typing import Any

from torch import nn

from gpipe_repro.repro.validate_unseen import PreNormResidual


def residual_mlp(width: int = 768, blocks: int = 8, classes: int = 10) -> nn.Sequential:
    """Residual GELU blocks on (batch, width) features, hidden 4 x width and 1 x width in turn."""
    return nn.Sequential(*[PreNormResidual(width, width * (4 if i % 2 == 0 else 1)) for i in range(blocks)],
                         nn.LayerNorm(width), nn.Linear(width, classes))


def conv_pyramid(channels: int = 16, stages: int = 4, classes: int = 10) -> nn.Sequential:
    """3x3 conv + BatchNorm + ReLU pairs on 3x32x32 images; each stage doubles the channels and
    halves the resolution (a stride-2 convolution)."""
    layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels),
                                             nn.ReLU())]
    c = channels
    for _ in range(stages - 1):
        layers.append(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()))
        layers.append(nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.BatchNorm2d(2 * c),
                                    nn.ReLU()))
        c *= 2
    return nn.Sequential(*layers, nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()), nn.Linear(c, classes))


class _MeanPool(nn.Module):
    def forward(self, x: Any) -> Any:
        return x.mean(dim=1)


def transformer_blocks(d_model: int = 256, blocks: int = 6, heads: int = 4,
                       classes: int = 10) -> nn.Sequential:
    """Pre-norm Transformer encoder blocks on (batch, 32 tokens, d_model) features, mean-pooled."""
    return nn.Sequential(*[nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                                      batch_first=True, norm_first=True)
                           for _ in range(blocks)], _MeanPool(), nn.Linear(d_model, classes))
