"""Decoders for a pipelined ``translation_transformer()``: a key/value cache in both runtimes.

Why a cache. Decoding is autoregressive: the encoder once, then the decoder once per target position
on a small batch. Without a cache each step recomputes the whole prefix, so the cost grows with the
square of the length (it took longer than training in our CPU runs, and 15x longer than the cached
decoder under the distributed runtime). So every decoder here caches: `StageDecoder` decodes one
position at a time on a run of consecutive layers, keeping the keys and values of its decoder layers.
When one process holds every cell on one device, `LayerDecoder` is that on the pipeline's own layer
objects; when each cell is its own process (`--runtime distributed`), `DistributedDecoder` runs it on
each rank's cell and passes the new position's state from stage to stage (the same arithmetic, so the
same hypotheses and BLEU as the local runtime). Only cells on several devices of one process (the
local runtime on GPUs) decode through the pipeline's forward (`PipelineDecoder`, no cache), which is
also the cached decoders' independent reference in the tests. Each is a
:class:`~gpipe_repro.train.tasks.translation_search.Decoder`; :func:`decoder_for` picks one.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_repro.models.transformer_lm import MultiHeadAttention, sinusoidal_positions
from gpipe_repro.models.translation import (
    DecoderLayer,
    EncoderLayer,
    EncoderNorm,
    OutputProjection,
    TranslationEmbedding,
)
from gpipe_repro.train.tasks.translation_search import Decoder, State


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


class DistributedDecoder:
    """Cached decoding when each stage of the pipeline is its own process (``--runtime distributed``):
    a :class:`Decoder` that every rank of one pipeline runs in step (SPMD, as the run loop is).

    Each rank decodes with a :class:`StageDecoder` on its own cell, holding the key/value caches of
    its own decoder layers; at the start the encoder state and source mask go from stage to stage
    once, at every step the new position's decoder state (N, 1, d) does, and the last stage sends
    the logits to every other stage of its pipeline, so every rank takes the same greedy or beam
    decision. Messages are torch.distributed's point-to-point object messages
    (``send_object_list`` / ``recv_object_list``) on the CPU control group (gloo), as the runtime's
    own forward shares its output: the size of the pickled tensors goes first, so no rank needs to
    know the others' shapes, and they time out like the pipeline's own messages (the job's
    `--timeout`). Decoding runs between steps, on every rank in the same order, so no pipeline
    message is in flight to be confused with them. With replicas every pipeline decodes the whole
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
        # copies on the CPU: a pickled view would carry its whole storage
        message = [[t.detach().to("cpu", copy=True) for t in tensors]]
        dist.send_object_list(message, self.offset + stage, group=self.group)

    def _recv(self, count: int, stage: int) -> list[torch.Tensor]:
        import torch.distributed as dist
        message: list[Any] = [None]
        dist.recv_object_list(message, self.offset + stage, group=self.group)
        tensors = message[0]
        if len(tensors) != count:
            raise RuntimeError(f"stage {self.stage} expected {count} tensor(s) from stage {stage} while "
                               f"decoding, got {len(tensors)}")
        return [t.to(self.device) for t in tensors]

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

