"""The translation task's training batches: temperature-sampled, length-bucketed, `batch_size`
sentences each, handed to the engine as ``((src_ids, tgt_in), (tgt_out, tokens))``.

Why sentences and not a token budget: the engine cuts a mini-batch into M micro-batches along the
sentence axis, so every mini-batch must hold at least M sentences, and "raise M at a fixed micro-batch
size" (the large-batch study) is only well defined in sentences.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gpipe_repro.data.language_sampling import TokenizedLanguage, TranslationBatch, train_batches

POOL_SENTENCES = 16384    # pairs drawn per bucketing pool (rounded to a multiple of the batch)


def pipeline_batch(batch: TranslationBatch) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                     tuple[torch.Tensor, torch.Tensor]]:
    """A TranslationBatch as the engine's (inputs, targets): ((src_ids, tgt_in), (tgt_out, tokens)),
    `tokens` the mini-batch's target-token count as a 0-dim float tensor (computed before the
    engine splits the batch, and given whole to every micro-batch)."""
    tokens = torch.tensor(float(batch.num_target_tokens))
    return (batch.src_ids, batch.tgt_in), (batch.tgt_out, tokens)


class TranslationBatches:
    """Endless temperature-sampled, length-bucketed batches of exactly `batch_size` sentences.

    The stream is a pure function of (data, batch size, seed), so its position is just the number
    of batches drawn: `load_state_dict` regenerates the stream and skips that many (collating a
    batch takes well under a millisecond, so replaying even 10^4 batches costs seconds).
    """

    def __init__(self, data: dict[str, TokenizedLanguage], batch_size: int, seed: int,
                 temperature: float, pad_id: int, bos_id: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.temperature, self.pad_id, self.bos_id = temperature, pad_id, bos_id
        total = sum(len(d) for d in data.values())
        self.batches_per_epoch = max(1, total // batch_size)
        self.drawn, self.tokens = 0, 0
        self._stream = self._new_stream()

    def _new_stream(self) -> Iterator[TranslationBatch]:
        pool = self.batch_size * max(1, POOL_SENTENCES // self.batch_size)
        return train_batches(self.data, max_tokens=None, max_sentences=self.batch_size,
                             temperature=self.temperature, seed=self.seed, pool_size=pool,
                             pad_id=self.pad_id, bos_id=self.bos_id)

    def next_batch(self) -> TranslationBatch:
        batch = next(self._stream)
        self.drawn += 1
        self.tokens += batch.num_target_tokens
        return batch

    def __iter__(self) -> TranslationBatches:
        return self

    def __next__(self) -> tuple[Any, Any]:
        return pipeline_batch(self.next_batch())

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "tokens": self.tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._stream, self.drawn, self.tokens = self._new_stream(), 0, 0
        for _ in range(int(state["drawn"])):
            self.next_batch()
        if self.tokens != int(state["tokens"]):
            raise ValueError("the training data changed since the checkpoint was saved (the replayed "
                             f"stream has {self.tokens} tokens where the run had {state['tokens']}): "
                             "resume with the corpus and vocabulary the run started with")
