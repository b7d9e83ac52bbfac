"""T(L, H, A): the paper's encoder-decoder translation Transformer as ONE layer sequence.

Why one sequence: GPipe pipelines the encoder and the decoder together, so the encoder's output must
reach every decoder layer whatever cell it lands in. Every boundary therefore carries the tuple

    (enc, dec, src_mask)

- ``enc`` (N, S, d): the encoder state; after the ``encoder_norm`` layer, the encoder output, which
  then travels unchanged through the decoder layers (each reads it for cross-attention, and its
  gradient flows back across the boundaries to the encoder);
- ``dec`` (N, T, d): the decoder state; the embedded decoder input rides along the encoder layers
  untouched until the decoder layers update it;
- ``src_mask`` (N, S) bool, True at real source tokens (pad positions are never attended to).

The first layer takes ``(src_ids, tgt_in_ids)`` (int tensors, lengths S and T may differ) and embeds
both with the shared source/target embedding; the last layer returns logits (N, T, vocab). The
sequence is ``embed, encoder_0..L-1, encoder_norm, decoder_0..L-1, output``: 2L + 3 layers.

Shape (the paper's section 5): model dimension 1024, feed-forward H, A heads of 64 channels, so the
attention projections map d -> 64A -> d (1024 for A=16, 2048 for A=32). Pre-LayerNorm, sinusoidal
positions, SDPA everywhere.

The paper's two trainability fixes for deep models:
- ``scale_ff_init``: every feed-forward layer's weights are initialized (Xavier) and then scaled
  down by the number of layers L (both of its matrices);
- ``logit_clip``: logits are hard-clamped to [-c, c] (``torch.clamp``, as lingvo's
  ``logits_abs_max`` does; gradients of clamped logits are zero).

Weight tying: the source embedding, the target embedding and the output projection share one matrix
by default (``tie_embeddings=True``); the first and last layers then hold the same ``nn.Parameter``.

Decoding (greedy here, beam search elsewhere) uses :func:`encode` once and :func:`decode_logits`
per step on a plain, non-pipelined layer list.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_repro.models.transformer_lm import (
    FeedForward,
    MultiHeadAttention,
    init_transformer_weights,
    sinusoidal_positions,
)

Boundary = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# A layer list, read more than once (an nn.Sequential is not a Sequence).
Layers = Sequence[nn.Module] | nn.Sequential


class TranslationEmbedding(nn.Module):
    """(src_ids, tgt_in_ids) -> (src embeddings, tgt embeddings, src_mask)."""

    def __init__(self, vocab_size: int, d_model: int, pad_id: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pad_id = pad_id
        self.scale = math.sqrt(d_model)
        self.dropout = nn.Dropout(dropout)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.scale
        x = x + sinusoidal_positions(ids.shape[1], x.shape[-1], x.device, x.dtype)
        return self.dropout(x)

    def embed_source(self, src_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Source ids (N, S) -> (embeddings (N, S, d), src_mask (N, S) bool, True = real token)."""
        return self._embed(src_ids), src_ids != self.pad_id

    def embed_target(self, tgt_ids: torch.Tensor) -> torch.Tensor:
        return self._embed(tgt_ids)

    def forward(self, ids: tuple[torch.Tensor, torch.Tensor]) -> Boundary:
        if not (isinstance(ids, tuple) and len(ids) == 2):
            raise ValueError("T(L,H,A) takes the tuple (src_ids, tgt_in_ids) as its input")
        src_ids, tgt_ids = ids
        enc, src_mask = self.embed_source(src_ids)
        return enc, self.embed_target(tgt_ids), src_mask


class EncoderLayer(nn.Module):
    """Pre-LN self-attention (source padding masked) + feed-forward on `enc`; `dec` passes through."""

    def __init__(self, d_model: int, d_ff: int, num_heads: int, head_dim: int,
                 dropout: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, num_heads, head_dim, dropout)
        self.ln_ff = nn.LayerNorm(d_model)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.dropout = nn.Dropout(dropout)

    def encode(self, enc: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        enc = enc + self.dropout(self.attn(self.ln_attn(enc), key_mask=src_mask))
        return enc + self.dropout(self.ff(self.ln_ff(enc)))

    def forward(self, x: Boundary) -> Boundary:
        enc, dec, src_mask = x
        return self.encode(enc, src_mask), dec, src_mask


class EncoderNorm(nn.Module):
    """The encoder's final LayerNorm: turns the encoder state into the encoder output."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)

    def forward(self, x: Boundary) -> Boundary:
        enc, dec, src_mask = x
        return self.ln(enc), dec, src_mask


class DecoderLayer(nn.Module):
    """Pre-LN causal self-attention, cross-attention to the encoder output, feed-forward on `dec`."""

    def __init__(self, d_model: int, d_ff: int, num_heads: int, head_dim: int,
                 dropout: float) -> None:
        super().__init__()
        self.ln_self = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, num_heads, head_dim, dropout)
        self.ln_cross = nn.LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, head_dim, dropout)
        self.ln_ff = nn.LayerNorm(d_model)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.dropout = nn.Dropout(dropout)

    def decode(self, dec: torch.Tensor, enc: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        dec = dec + self.dropout(self.self_attn(self.ln_self(dec), causal=True))
        dec = dec + self.dropout(self.cross_attn(self.ln_cross(dec), memory=enc, key_mask=src_mask))
        return dec + self.dropout(self.ff(self.ln_ff(dec)))

    def forward(self, x: Boundary) -> Boundary:
        enc, dec, src_mask = x
        return enc, self.decode(dec, enc, src_mask), src_mask


class OutputProjection(nn.Module):
    """Final decoder LayerNorm and the vocabulary projection (tied or not), with optional clipping."""

    def __init__(self, d_model: int, vocab_size: int, tied: nn.Embedding | None,
                 logit_clip: float | None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.weight = tied.weight if tied is not None else nn.Parameter(torch.empty(vocab_size, d_model))
        if tied is None and not self.weight.is_meta:
            nn.init.normal_(self.weight, std=d_model ** -0.5)
        self.tied = tied is not None
        self.logit_clip = logit_clip

    def logits(self, dec: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.ln(dec), self.weight)
        if self.logit_clip is not None:
            logits = logits.clamp(-self.logit_clip, self.logit_clip)
        return logits

    def forward(self, x: Boundary) -> torch.Tensor:
        return self.logits(x[1])


def translation_transformer(L: int, H: int = 8192, A: int = 16, *, d_model: int = 1024,
                            head_dim: int = 64, vocab_size: int = 64000, pad_id: int = 0,
                            dropout: float = 0.1, tie_embeddings: bool = True,
                            scale_ff_init: bool = True,
                            logit_clip: float | None = None) -> nn.Sequential:
    """T(L, H, A) as a flat ``nn.Sequential`` of 2L + 3 layers (see the module docstring)."""
    if L < 1:
        raise ValueError(f"T(L,H,A) needs L >= 1, got L={L}")
    if logit_clip is not None and logit_clip <= 0:
        raise ValueError(f"logit_clip must be positive or None, got {logit_clip}")
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    embedding = TranslationEmbedding(vocab_size, d_model, pad_id, dropout)
    layers["embed"] = embedding
    for i in range(L):
        layers[f"encoder_{i}"] = EncoderLayer(d_model, H, A, head_dim, dropout)
    layers["encoder_norm"] = EncoderNorm(d_model)
    for i in range(L):
        layers[f"decoder_{i}"] = DecoderLayer(d_model, H, A, head_dim, dropout)
    model = nn.Sequential(layers)
    init_transformer_weights(model)
    if scale_ff_init and not embedding.embed.weight.is_meta:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, FeedForward):
                    for linear in m:        # its two projections
                        if isinstance(linear, nn.Linear):
                            linear.weight.mul_(1.0 / L)
    model.add_module("output", OutputProjection(d_model, vocab_size,
                                                embedding.embed if tie_embeddings else None,
                                                logit_clip))
    return model


def embedding_parameters(model: nn.Sequential) -> list[torch.Tensor]:
    """The vocabulary matrices (the shared embedding, and the output matrix if untied)."""
    emb = _find(model, TranslationEmbedding).embed.weight
    out = _find(model, OutputProjection).weight
    return [emb] if out is emb else [emb, out]


def count_non_embedding(model: nn.Sequential) -> int:
    """Parameters other than the vocabulary matrices (the paper's model-size convention)."""
    skip = {id(p) for p in embedding_parameters(model)}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


# --------------------------------------------------------------------------------------------
# Decoding on a plain (non-pipelined) layer list
# --------------------------------------------------------------------------------------------

_M = TypeVar("_M", bound=nn.Module)


def _find(layers: Iterable[nn.Module], kind: type[_M]) -> _M:
    for layer in layers:
        if isinstance(layer, kind):
            return layer
    raise ValueError(f"no {kind.__name__} in this layer list; is it a translation_transformer()?")


def encode(layers: Layers, src_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the embedding and the encoder once: (encoder output (N, S, d), src_mask (N, S))."""
    enc, src_mask = _find(layers, TranslationEmbedding).embed_source(src_ids)
    for layer in layers:
        if isinstance(layer, EncoderLayer):
            enc = layer.encode(enc, src_mask)
    return _find(layers, EncoderNorm).ln(enc), src_mask


def decode_logits(layers: Layers, enc: torch.Tensor, src_mask: torch.Tensor,
                  tgt_prefix: torch.Tensor) -> torch.Tensor:
    """Logits (N, T, vocab) of the decoder on the target prefix (N, T), given the encoder output.

    For a decoding step use the last position, ``decode_logits(...)[:, -1]``. Beams are expanded by
    repeating `enc` and `src_mask` along dim 0. (No key/value cache: each step recomputes the prefix,
    which is simple and fine at evaluation sizes.)
    """
    dec = _find(layers, TranslationEmbedding).embed_target(tgt_prefix)
    for layer in layers:
        if isinstance(layer, DecoderLayer):
            dec = layer.decode(dec, enc, src_mask)
    return _find(layers, OutputProjection).logits(dec)


@torch.no_grad()
def greedy_decode(layers: Layers, src_ids: torch.Tensor, bos_id: int, eos_id: int,
                  max_len: int, pad_id: int = 0) -> torch.Tensor:
    """Greedy translation: (N, <= max_len + 1) ids starting with `bos_id`, padded after `eos_id`."""
    enc, src_mask = encode(layers, src_ids)
    out = torch.full((src_ids.shape[0], 1), bos_id, dtype=torch.long, device=src_ids.device)
    done = torch.zeros(src_ids.shape[0], dtype=torch.bool, device=src_ids.device)
    for _ in range(max_len):
        nxt = decode_logits(layers, enc, src_mask, out)[:, -1].argmax(dim=-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        out = torch.cat([out, nxt[:, None]], dim=1)
        done |= nxt == eos_id
        if bool(done.all()):
            break
    return out


def translation_loss(logits: torch.Tensor, targets: torch.Tensor, pad_id: int = 0,
                     label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """Token cross-entropy of logits (N, T, V) against targets (N, T), ignoring `pad_id`.

    For a token-level mean over a whole mini-batch under micro-batching, use ``reduction="sum"``
    divided by the mini-batch's token count (see docs/design.md, "Losses").
    """
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=pad_id,
                           label_smoothing=label_smoothing, reduction=reduction)
