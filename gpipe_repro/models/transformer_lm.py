"""Transformer-L, the decoder-only language model of the paper's Tables 1 and 2, as a layer sequence.

Why this shape: Table 1 scales a Transformer by stacking L identical layers (d=2048, feed-forward
8192, 32 heads) between an input embedding and a separate 32k x d softmax. Each layer is a pipeline
layer: token ids (int) go into the embedding, hidden states ``(N, T, d)`` cross every boundary, and
the head returns logits ``(N, T, vocab)``. Per layer 4d^2 + 2 d d_ff weights (+ biases and two
LayerNorms); embeddings 2 x 32000 x d; so L=3 is 282M, L=13 786M, L=103 5.32B parameters.

Layers are pre-LayerNorm (``x + attn(ln(x))``, ``x + ffn(ln(x))``), causal, with sinusoidal
positions (no parameters), and attention through ``F.scaled_dot_product_attention``.

The attention, feed-forward and position helpers here are shared with the translation model.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn


def sinusoidal_positions(length: int, dim: int, device: torch.device | None = None,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (length, dim) sine/cosine position table of Vaswani et al. (computed, not stored)."""
    position = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(1)
    rate = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32)
                     * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, device=device, dtype=torch.float32)
    table[:, 0::2] = torch.sin(position * rate)
    table[:, 1::2] = torch.cos(position * rate)[:, : dim // 2]
    return table.to(dtype)


class MultiHeadAttention(nn.Module):
    """Multi-head attention d_model -> heads x head_dim -> d_model, through SDPA.

    `head_dim` may differ from d_model / heads (T(L,H,A) uses 64 channels per head at d_model 1024).
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}; "
                                 "pass head_dim explicitly")
            head_dim = d_model // num_heads
        self.num_heads, self.head_dim, self.dropout = num_heads, head_dim, dropout
        inner = num_heads * head_dim
        self.q = nn.Linear(d_model, inner)
        self.kv = nn.Linear(d_model, 2 * inner)
        self.out = nn.Linear(inner, d_model)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        return x.view(n, t, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        """Attend from `x` to `memory` (itself if None). `key_mask` (N, S) bool: True = attend."""
        source = x if memory is None else memory
        q = self._split(self.q(x))
        k, v = (self._split(t) for t in self.kv(source).chunk(2, dim=-1))
        mask = None if key_mask is None else key_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        n, _, t, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(n, t, self.num_heads * self.head_dim))


class FeedForward(nn.Sequential):
    """Linear d -> d_ff, ReLU, dropout, Linear d_ff -> d."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0) -> None:
        super().__init__(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(d_ff, d_model))


class TokenEmbedding(nn.Module):
    """Token ids (N, T) -> embeddings x sqrt(d) + sinusoidal positions, dropout."""

    def __init__(self, vocab_size: int, d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.dropout = nn.Dropout(dropout)
        self.scale = math.sqrt(d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype.is_floating_point or ids.dim() != 2:
            raise ValueError(f"expected integer token ids of shape (N, T), got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        x = self.embed(ids) * self.scale
        x = x + sinusoidal_positions(ids.shape[1], x.shape[-1], x.device, x.dtype)
        return self.dropout(x)


class TransformerLayer(nn.Module):
    """Pre-LN causal self-attention + feed-forward: hidden (N, T, d) -> hidden (N, T, d)."""

    def __init__(self, d_model: int, d_ff: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, num_heads, dropout=dropout)
        self.ln_ff = nn.LayerNorm(d_model)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_attn(x), causal=True))
        return x + self.dropout(self.ff(self.ln_ff(x)))


class LMHead(nn.Module):
    """Final LayerNorm and the (untied) softmax projection: hidden -> logits (N, T, vocab)."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))


def init_transformer_weights(model: nn.Module) -> None:
    """Xavier-uniform linear weights, zero biases, embeddings N(0, d^-1/2) (they are scaled by sqrt(d)).

    Skipped on the meta device, where there are no values (and counting 83.9B parameters stays fast).
    """
    if any(p.is_meta for p in model.parameters()):
        return
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=m.embedding_dim ** -0.5)


def transformer_lm(L: int, d_model: int = 2048, d_ff: int = 8192, num_heads: int = 32,
                   vocab_size: int = 32000, dropout: float = 0.0) -> nn.Sequential:
    """Transformer-L: ``embed``, ``layer_0`` .. ``layer_{L-1}``, ``head`` (see the module docstring)."""
    if L < 1:
        raise ValueError(f"Transformer-L needs at least one layer, got L={L}")
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    layers["embed"] = TokenEmbedding(vocab_size, d_model, dropout)
    for i in range(L):
        layers[f"layer_{i}"] = TransformerLayer(d_model, d_ff, num_heads, dropout)
    layers["head"] = LMHead(d_model, vocab_size)
    model = nn.Sequential(layers)
    init_transformer_weights(model)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (N, T, V) against targets (N, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
