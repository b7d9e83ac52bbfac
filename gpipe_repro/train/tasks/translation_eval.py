"""Scoring a many-to-English model: decode (greedy or beam), BLEU per language and per resource group,
token NLL.

Why pooled BLEU per group. The paper contrasts high- and low-resource languages. Our low-resource
test sets hold a few dozen short sentences each, so a per-language BLEU swings by several points
with one sentence; pooling the n-gram statistics of every sentence of a group into one corpus BLEU
(sacrebleu over the concatenated hypotheses and references) is far steadier than averaging noisy
per-language scores. Both are reported: pooled per group, and the per-language scores (with their
sentence counts) for the plot against training-set size.

Why decoding uses a key/value cache, in both runtimes. Decoding is autoregressive: the encoder once,
then the decoder once per target position on a small batch. Without a cache each step recomputes the
whole prefix, so the cost grows with the square of the length (it took longer than training in our CPU
runs, and 15x longer than the cached decoder under the distributed runtime). So every
decoder here caches: `StageDecoder` decodes one position at a time on a run of consecutive layers,
keeping the keys and values of its decoder layers. When one process holds every cell on one device,
`LayerDecoder` is that on the pipeline's own layer objects; when each cell is its own process
(`--runtime distributed`), `DistributedDecoder` runs it on each rank's cell and passes the new
position's state from stage to stage (the same arithmetic, so the same hypotheses and BLEU as the
local runtime). Only cells on several devices of one process (the local runtime on GPUs) decode
through the pipeline's forward (`PipelineDecoder`, no cache), which is also the cached decoders'
independent reference in the tests. Teacher-forced NLL, one big batch, always goes through the
pipelined forward. The greedy and beam loops (`greedy_search`, `beam_search`) are written once,
against the `Decoder` protocol.

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
from gpipe_repro.models.translation import (
    DecoderLayer,
    EncoderLayer,
    EncoderNorm,
    OutputProjection,
    TranslationEmbedding,
)

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


class StageDecoder:
    """Cached incremental decoding on a run of consecutive layers of ``translation_transformer()``
    (the whole model, or one pipeline stage's cell).

    The encoder runs once (:meth:`start`); each decoder layer of the run keeps the keys and values of
    every earlier target position (self-attention) and of the encoder output (cross-attention), so a
    step (:meth:`step`) costs one position instead of the whole prefix. It is ``DecoderLayer.decode``
    unrolled one position at a time (eval mode: no dropout). What crosses from one run to the next is
    what the pipeline's boundary carries, reduced to decoding: at the start (encoder state, source
    mask), at each step the decoder state of the new position (N, 1, d). The first run takes the
    source ids and the last tokens; the last run returns the logits (N, vocab).
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self.embedding = next((m for m in self.layers if isinstance(m, TranslationEmbedding)), None)
        self.encoders = [m for m in self.layers if isinstance(m, EncoderLayer)]
        self.norm = next((m for m in self.layers if isinstance(m, EncoderNorm)), None)
        self.decoders = [m for m in self.layers if isinstance(m, DecoderLayer)]
        self.output = next((m for m in self.layers if isinstance(m, OutputProjection)), None)
        self.position = 0    # target positions decoded since the last start (every run agrees)

    @property
    def is_first(self) -> bool:
        """Whether this run holds the embedding (it takes ids, not a boundary)."""
        return self.embedding is not None

    @property
    def is_last(self) -> bool:
        """Whether this run holds the output projection (it returns logits)."""
        return self.output is not None

    def start_stage(self, src_ids: torch.Tensor, carry: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> tuple[tuple[torch.Tensor, torch.Tensor], State]:
        """Encode: ((encoder state, src_mask) for the next run, this run's initial state). The first
        run embeds `src_ids`; the others continue from the previous run's `carry`."""
        if self.embedding is not None:
            enc, src_mask = self.embedding.embed_source(src_ids)
        elif carry is None:
            raise ValueError("this run of layers has no embedding: pass the previous run's carry")
        else:
            enc, src_mask = carry
        for encoder in self.encoders:
            enc = encoder.encode(enc, src_mask)
        if self.norm is not None:
            enc = self.norm.ln(enc)
        state: State = [src_mask]
        for layer in self.decoders:
            attn = layer.cross_attn
            k, v = (_heads(attn, t) for t in attn.kv(enc).chunk(2, dim=-1))
            empty = k.new_zeros(k.shape[0], layer.self_attn.num_heads, 0, layer.self_attn.head_dim)
            state += [k, v, empty, empty]
        self.position = 0
        return (enc, src_mask), state

    def step_stage(self, state: State, x: torch.Tensor) -> tuple[torch.Tensor, State]:
        """One target position: `x` is the last tokens (N,) for the first run, else the previous
        run's output (N, 1, d); returns (logits (N, vocab) for the last run, else (N, 1, d); state)."""
        src_mask, caches = state[0], state[1:]
        position = self.position
        self.position += 1
        if self.embedding is not None:
            emb = self.embedding
            x = emb.embed(x[:, None]) * emb.scale
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
        if self.output is not None:
            return self.output.logits(x)[:, -1], new_state
        return x, new_state


class LayerDecoder(StageDecoder):
    """Cached decoding on the whole layer list in one process (a :class:`Decoder`);
    tests/train/test_translation.py checks that its logits equal `decode_logits` on the full prefix."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__(layers)
        if not (self.is_first and self.is_last):
            raise ValueError("LayerDecoder needs the whole model (embedding to output projection); "
                             "for one stage's cell use StageDecoder")

    def start(self, src_ids: torch.Tensor) -> State:
        return self.start_stage(src_ids, None)[1]

    def step(self, state: State, tokens: torch.Tensor) -> tuple[torch.Tensor, State]:
        return self.step_stage(state, tokens)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool)
_HEADER = 8          # dtype index, number of dimensions, up to 6 sizes
_DECODE_TAG = 1 << 28   # above every tag the pipeline transport uses (no step is in flight anyway)


class DistributedDecoder:
    """Cached decoding when each stage of the pipeline is its own process (``--runtime distributed``):
    a :class:`Decoder` that every rank of one pipeline runs in step (SPMD, as the run loop is).

    Each rank decodes with a :class:`StageDecoder` on its own cell, holding the key/value caches of
    its own decoder layers; at the start the encoder state and source mask go from stage to stage
    once, at every step the new position's decoder state (N, 1, d) does, and the last stage sends
    the logits to every other stage of its pipeline, so every rank takes the same greedy or beam
    decision. Messages are point-to-point on the CPU control group (gloo), each preceded by a small
    header (dtype and shape), so no rank needs to know the others' shapes; they time out like the
    pipeline's own messages (the job's `--timeout`). With replicas every pipeline decodes the whole
    evaluation sample (the same result on each).
    """

    def __init__(self, layers: Sequence[nn.Module], *, stage: int, stages: int, rank_offset: int,
                 device: torch.device) -> None:
        self.stage_decoder = StageDecoder(layers)
        self.stage, self.stages, self.offset, self.device = stage, stages, rank_offset, device

    @property
    def group(self) -> Any:
        """The job's CPU control group (gloo)."""
        from gpipe_repro.distributed.process_group import control_group
        return control_group()

    def _send(self, tensors: Sequence[torch.Tensor], stage: int) -> None:
        import torch.distributed as dist
        for t in tensors:
            if t.dim() > _HEADER - 2:
                raise ValueError(f"cannot send a {t.dim()}-dimensional tensor while decoding")
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
            header[2: 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
            dist.send(header, self.offset + stage, group=self.group, tag=_DECODE_TAG)
            payload = t.detach().cpu().contiguous()
            if payload.dtype == torch.bool:
                payload = payload.to(torch.uint8)
            dist.send(payload, self.offset + stage, group=self.group, tag=_DECODE_TAG + 1)

    def _recv(self, count: int, stage: int) -> list[torch.Tensor]:
        import torch.distributed as dist
        out = []
        for _ in range(count):
            header = torch.empty(_HEADER, dtype=torch.int64)
            dist.recv(header, self.offset + stage, group=self.group, tag=_DECODE_TAG)
            dtype, ndim = _DTYPES[int(header[0])], int(header[1])
            shape = [int(n) for n in header[2: 2 + ndim]]
            payload = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype)
            dist.recv(payload, self.offset + stage, group=self.group, tag=_DECODE_TAG + 1)
            out.append(payload.to(device=self.device, dtype=dtype))
        return out

    def start(self, src_ids: torch.Tensor) -> State:
        """Encode through every stage in turn; this rank's initial state."""
        carry = None
        if self.stage > 0:
            enc, src_mask = self._recv(2, self.stage - 1)
            carry = (enc, src_mask)
        (enc, src_mask), state = self.stage_decoder.start_stage(src_ids.to(self.device), carry)
        if self.stage < self.stages - 1:
            self._send([enc, src_mask], self.stage + 1)
        return state

    def step(self, state: State, tokens: torch.Tensor) -> tuple[torch.Tensor, State]:
        """One position through every stage in turn; the last stage's logits on every rank."""
        last = self.stages - 1
        x = tokens.to(self.device) if self.stage == 0 else self._recv(1, self.stage - 1)[0]
        y, state = self.stage_decoder.step_stage(state, x)
        if self.stage < last:
            self._send([y], self.stage + 1)
            return self._recv(1, last)[0], state
        for other in range(last):
            self._send([y], other)
        return y, state


class PipelineDecoder:
    """Decode through a pipeline's forward (any K, any devices, either runtime): every step is a
    pipelined forward of (source, whole prefix), no cache. Slower than the cached decoders (its cost
    grows with the square of the length); kept as their independent reference in the tests."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def start(self, src_ids: torch.Tensor) -> State:
        return [src_ids, src_ids.new_zeros(src_ids.shape[0], 0)]

    def step(self, state: State, tokens: torch.Tensor) -> tuple[torch.Tensor, State]:
        src_ids, prefix = state
        prefix = torch.cat([prefix, tokens.to(prefix.device)[:, None]], dim=1)
        return self.pipe.forward((src_ids, prefix))[:, -1], [src_ids, prefix]


def decoder_for(pipe: Any) -> Decoder:
    """The cached decoder for a pipeline: :class:`LayerDecoder` on the pipeline's own layer objects
    when one process holds every cell on one device, :class:`DistributedDecoder` on this rank's cell
    when each stage is a process (``runtime="distributed"``). Cells on several devices of one process
    (the local runtime on GPUs) decode through the pipeline (:class:`PipelineDecoder`)."""
    if getattr(pipe, "rank", None) is not None:
        return DistributedDecoder(list(pipe.cells[pipe.rank]), stage=pipe.rank, stages=pipe.partitions,
                                  rank_offset=pipe.replica * pipe.partitions,
                                  device=pipe.devices[pipe.rank])
    if len({str(d) for d in pipe.devices}) <= 1:
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
