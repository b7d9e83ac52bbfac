"""Greedy and beam search, written once against the :class:`Decoder` protocol that every decoder of
`translation_decoders.py` implements."""
from __future__ import annotations

from typing import Protocol

import torch

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
