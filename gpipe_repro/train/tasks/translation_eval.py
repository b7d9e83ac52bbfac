"""Scoring a many-to-English model: decode (greedy or beam), BLEU per language and per resource group,
token NLL.

Why pooled BLEU per group. The paper contrasts high- and low-resource languages. Our low-resource
test sets hold a few dozen short sentences each, so a per-language BLEU swings by several points
with one sentence; pooling the n-gram statistics of every sentence of a group into one corpus BLEU
(sacrebleu over the concatenated hypotheses and references) is far steadier than averaging noisy
per-language scores. Both are reported: pooled per group, and the per-language scores (with their
sentence counts) for the plot against training-set size.

Why decoding mostly bypasses the pipeline. Decoding is autoregressive: the encoder once, then the
decoder once per target position on a small batch. A pipeline only pays off on large batches of
independent work, so when one process holds every cell on one device, `LayerDecoder` decodes on the
very layer objects the pipeline trains, with a key/value cache (the encoder once, one position per
step; without the cache decoding cost grows with the square of the length and took longer than
training in our CPU runs). Otherwise (cells on several devices, or one process per cell)
`PipelineDecoder` runs each step as a pipelined forward of (source, whole prefix): slower, but it
needs no single device holding the whole model. Teacher-forced NLL, one big batch, always goes
through the pipelined forward.

References are the corpus's raw English sentences (not the detokenized pieces), scored with
sacrebleu's default 13a tokenization.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpipe_repro.data.language_sampling import TokenizedLanguage, TranslationBatch, eval_batches
from gpipe_repro.models.transformer_lm import MultiHeadAttention, sinusoidal_positions
from gpipe_repro.models.translation import DecoderLayer, OutputProjection, TranslationEmbedding, encode

# Decoding stops at this many target pieces beyond the source length (or at eos, or at max_len).
LENGTH_SLACK = 10
# The GNMT length penalty exponent used to rank finished beams: ((5 + len) / 6) ** alpha.
LENGTH_PENALTY = 0.6

State = list[torch.Tensor]     # batch-first tensors a decoder carries from step to step


class Decoder(Protocol):
    """What greedy and beam search need. `start` encodes the sources; `step` takes the last token
    of every sentence and returns the next-token logits (N, vocab) and the new state. Every state
    tensor is batch-first, so beam search reorders hypotheses with `t[parent]` on each of them."""

    def start(self, src_ids: torch.Tensor) -> State: ...
    def step(self, state: State, tokens: torch.Tensor) -> tuple[torch.Tensor, State]: ...


def _heads(attn: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    n, t, _ = x.shape
    return x.view(n, t, attn.num_heads, attn.head_dim).transpose(1, 2)


def _merge(attn: MultiHeadAttention, y: torch.Tensor) -> torch.Tensor:
    n, _, t, _ = y.shape
    return attn.out(y.transpose(1, 2).reshape(n, t, attn.num_heads * attn.head_dim))


class LayerDecoder:
    """Incremental decoding on a plain layer list (one device), with a key/value cache.

    The encoder runs once; each decoder layer keeps the keys and values of every earlier target
    position (self-attention) and of the encoder output (cross-attention), so a step costs one
    position instead of the whole prefix. It is `DecoderLayer.decode` unrolled one position at a
    time (eval mode: no dropout); tests/train/test_translation.py checks that its logits equal
    `decode_logits` on the full prefix.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self.embedding = next(m for m in self.layers if isinstance(m, TranslationEmbedding))
        self.decoders = [m for m in self.layers if isinstance(m, DecoderLayer)]
        self.output = next(m for m in self.layers if isinstance(m, OutputProjection))

    def start(self, src_ids: torch.Tensor) -> State:
        enc, src_mask = encode(self.layers, src_ids)
        state: State = [src_mask]
        for layer in self.decoders:
            attn = layer.cross_attn
            k, v = (_heads(attn, t) for t in attn.kv(enc).chunk(2, dim=-1))
            empty = k.new_zeros(k.shape[0], layer.self_attn.num_heads, 0, layer.self_attn.head_dim)
            state += [k, v, empty, empty]
        return state

    def step(self, state: State, tokens: torch.Tensor) -> tuple[torch.Tensor, State]:
        src_mask, caches = state[0], state[1:]
        position = caches[2].shape[2]
        emb = self.embedding
        x = emb.embed(tokens[:, None]) * emb.scale
        x = x + sinusoidal_positions(position + 1, x.shape[-1], x.device, x.dtype)[position]
        key_mask = src_mask[:, None, None, :]
        new_state: State = [src_mask]
        for i, layer in enumerate(self.decoders):
            cross_k, cross_v, self_k, self_v = caches[4 * i: 4 * i + 4]
            attn = layer.self_attn
            h = layer.ln_self(x)
            k, v = (_heads(attn, t) for t in attn.kv(h).chunk(2, dim=-1))
            self_k, self_v = torch.cat([self_k, k], dim=2), torch.cat([self_v, v], dim=2)
            y = F.scaled_dot_product_attention(_heads(attn, attn.q(h)), self_k, self_v)
            x = x + _merge(attn, y)
            attn = layer.cross_attn
            y = F.scaled_dot_product_attention(_heads(attn, attn.q(layer.ln_cross(x))), cross_k,
                                               cross_v, attn_mask=key_mask)
            x = x + _merge(attn, y)
            x = x + layer.ff(layer.ln_ff(x))
            new_state += [cross_k, cross_v, self_k, self_v]
        return self.output.logits(x)[:, -1], new_state


class PipelineDecoder:
    """Decode through a pipeline's forward (any K, any devices, either runtime): every step is a
    pipelined forward of (source, whole prefix); slower than LayerDecoder, but it needs no single
    device holding the whole model."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def start(self, src_ids: torch.Tensor) -> State:
        return [src_ids, src_ids.new_zeros(src_ids.shape[0], 0)]

    def step(self, state: State, tokens: torch.Tensor) -> tuple[torch.Tensor, State]:
        src_ids, prefix = state
        prefix = torch.cat([prefix, tokens.to(prefix.device)[:, None]], dim=1)
        return self.pipe.forward((src_ids, prefix))[:, -1], [src_ids, prefix]


def decoder_for(pipe: Any) -> Decoder:
    """LayerDecoder on the pipeline's own layer objects when one process holds every cell on one
    device; PipelineDecoder otherwise (cells on several devices, or one process per cell)."""
    if getattr(pipe, "rank", None) is None and len({str(d) for d in pipe.devices}) <= 1:
        return LayerDecoder([layer for cell in pipe.cells for layer in cell])
    return PipelineDecoder(pipe)


@torch.no_grad()
def greedy_search(decoder: Decoder, src_ids: torch.Tensor, *, bos_id: int, eos_id: int,
                  max_len: int, pad_id: int = 0) -> torch.Tensor:
    """Greedy translation: (N, <= max_len + 1) ids starting with `bos_id`, padded after `eos_id`."""
    state = decoder.start(src_ids)
    out = torch.full((src_ids.shape[0], 1), bos_id, dtype=torch.long, device=src_ids.device)
    done = torch.zeros(src_ids.shape[0], dtype=torch.bool, device=src_ids.device)
    for _ in range(max_len):
        logits, state = decoder.step(state, out[:, -1])
        nxt = logits.argmax(dim=-1).to(out.device)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        out = torch.cat([out, nxt[:, None]], dim=1)
        done |= nxt == eos_id
        if bool(done.all()):
            break
    return out


@torch.no_grad()
def beam_search(decoder: Decoder, src_ids: torch.Tensor, *, beam: int, bos_id: int, eos_id: int,
                max_len: int, pad_id: int = 0, length_penalty: float = LENGTH_PENALTY) -> torch.Tensor:
    """Beam search: (N, <= max_len + 1) ids starting with `bos_id`, padded after `eos_id`.

    Every sentence keeps `beam` hypotheses; a finished one (it emitted eos) only extends with pad at
    no cost. The best hypothesis is the highest log-probability divided by the GNMT length penalty.
    `beam=1` gives the greedy translation.
    """
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    n, device = src_ids.shape[0], src_ids.device
    state = [t.repeat_interleave(beam, 0) for t in decoder.start(src_ids)]
    seqs = torch.full((n * beam, 1), bos_id, dtype=torch.long, device=device)
    scores = torch.zeros(n, beam, device=device)
    scores[:, 1:] = float("-inf")          # all beams start identical: keep one alive at first
    finished = torch.zeros(n * beam, dtype=torch.bool, device=device)
    rows = torch.arange(n, device=device)[:, None] * beam
    for _ in range(max_len):
        logits, state = decoder.step(state, seqs[:, -1])
        logp = logits.float().log_softmax(-1).to(device)
        vocab = logp.shape[-1]
        logp[finished] = float("-inf")
        logp[finished, pad_id] = 0.0
        top, flat = (scores.reshape(-1, 1) + logp).reshape(n, beam * vocab).topk(beam, dim=1)
        parent = (rows + flat // vocab).reshape(-1)
        token = (flat % vocab).reshape(-1)
        seqs = torch.cat([seqs[parent], token[:, None]], dim=1)
        state = [t[parent.to(t.device)] for t in state]
        finished = finished[parent] | (token == eos_id)
        scores = top
        if bool(finished.all()):
            break
    lengths = (seqs[:, 1:] != pad_id).sum(dim=1).float()
    ranked = scores.reshape(-1) / ((5.0 + lengths) / 6.0) ** length_penalty
    best = ranked.reshape(n, beam).argmax(dim=1)
    return seqs.reshape(n, beam, -1)[torch.arange(n, device=device), best]


def decode_batch(decoder: Decoder, src_ids: torch.Tensor, *, beam: int, bos_id: int,
                 eos_id: int, pad_id: int, max_len: int) -> torch.Tensor:
    """Translate one padded source batch: greedy for beam 1, else beam search. The length limit
    is min(max_len, longest source + LENGTH_SLACK)."""
    limit = min(max_len, int(src_ids.shape[1]) + LENGTH_SLACK)
    if beam == 1:
        return greedy_search(decoder, src_ids, bos_id=bos_id, eos_id=eos_id, max_len=limit,
                             pad_id=pad_id)
    return beam_search(decoder, src_ids, beam=beam, bos_id=bos_id, eos_id=eos_id, max_len=limit,
                       pad_id=pad_id)


def evenly_spaced(n: int, limit: int | None) -> np.ndarray:
    """`limit` indices spread evenly over range(n) (all of them when n <= limit): a deterministic
    sample that does not favour one end of a file sorted by its English side."""
    if limit is None or n <= limit:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, limit).round().astype(np.int64))


def subset(data: TokenizedLanguage, indices: np.ndarray) -> TokenizedLanguage:
    return TokenizedLanguage.from_lists([data.source(int(i)).tolist() for i in indices],
                                        [data.target(int(i)).tolist() for i in indices])


@dataclass
class EvalLanguage:
    """One language's evaluation sample: its tokenized pairs and the raw English references."""
    language: str
    index: int                   # position in the task's sorted language list (its src_lang id)
    data: TokenizedLanguage
    references: list[str]
    train_size: int
    group: str                   # "high" | "low"


@torch.no_grad()
def translate(decoder: Decoder, item: EvalLanguage, decode_text: Callable[[list[int]], str], *,
              device: torch.device, beam: int, max_tokens: int, max_len: int, pad_id: int,
              bos_id: int, eos_id: int) -> list[str]:
    """Hypotheses for every pair of `item`, in its order (eval_batches sorts by length; `index`
    puts them back). `decode_text(ids) -> str` is the tokenizer's decode; `device` is where the
    decoder takes its source ids (the first cell's)."""
    out: list[str] = [""] * len(item.data)
    for batch in eval_batches(item.data, item.index, max_tokens=max_tokens, pad_id=pad_id,
                              bos_id=bos_id):
        ids = decode_batch(decoder, batch.src_ids.to(device), beam=beam, bos_id=bos_id,
                           eos_id=eos_id, pad_id=pad_id, max_len=max_len).cpu()
        for row, position in enumerate(batch.index.tolist()):
            out[position] = decode_text(ids[row, 1:].tolist())
    return out


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """sacrebleu corpus BLEU (13a tokenization, default smoothing); 0 for an empty set."""
    import sacrebleu

    if not hypotheses:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def bleu_by_language_and_group(hypotheses: Mapping[str, Sequence[str]],
                               items: Sequence[EvalLanguage]) -> dict[str, float]:
    """`bleu_<lang>` per language, `bleu_<group>` pooled over each group's sentences, `bleu` pooled
    over every sentence, and `bleu_<group>_mean` (the unweighted mean of the group's languages)."""
    metrics: dict[str, float] = {}
    pooled: dict[str, tuple[list[str], list[str]]] = {}
    per_group: dict[str, list[float]] = {}
    for item in items:
        hyps = list(hypotheses[item.language])
        score = corpus_bleu(hyps, item.references)
        metrics[f"bleu_{item.language}"] = score
        per_group.setdefault(item.group, []).append(score)
        for key in (item.group, "all"):
            h, r = pooled.setdefault(key, ([], []))
            h += hyps
            r += item.references
    for key, (h, r) in sorted(pooled.items()):
        metrics["bleu" if key == "all" else f"bleu_{key}"] = corpus_bleu(h, r)
    for group, scores in sorted(per_group.items()):
        metrics[f"bleu_{group}_mean"] = float(np.mean(scores))
    return metrics


def teacher_forced_batches(items: Sequence[EvalLanguage], max_tokens: int, pad_id: int,
                           bos_id: int) -> Iterator[TranslationBatch]:
    for item in items:
        yield from eval_batches(item.data, item.index, max_tokens=max_tokens, pad_id=pad_id,
                                bos_id=bos_id)


def token_nll(outputs: Iterator[torch.Tensor], batches: Sequence[TranslationBatch],
              pad_id: int) -> float:
    """Mean negative log-likelihood per target token (nats, no label smoothing) of logits
    `outputs` (one per batch, e.g. a pipelined forward) against the batches' `tgt_out`."""
    total, tokens = 0.0, 0
    for batch, logits in zip(batches, outputs):
        target = batch.tgt_out.to(logits.device)
        total += float(F.cross_entropy(logits.float().flatten(0, 1), target.flatten(),
                                       ignore_index=pad_id, reduction="sum"))
        tokens += batch.num_target_tokens
    return total / max(tokens, 1)
