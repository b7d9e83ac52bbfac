"""Text as byte-level token ids packed into fixed-length rows, and the training stream over them.

Why bytes: every model family then reads the same ids (0..255, plus an end-of-document id), with no
tokenizer to train, download or cache, whatever the text's script; the vocabulary any config has
(>= :data:`VOCAB`) can hold them.

Packing (:func:`pack`): each document is its UTF-8 bytes followed by :data:`EOS`; documents are laid
one after another into rows of ``seq_len`` ids, a document that does not fit in what is left of a
row starting the next one (one longer than a row is cut into row-sized pieces). The rest of a row is
padding: ``attention_mask`` 0 and label -100, so the loss (:class:`gpipe_repro.models.hf.CausalLMLoss`,
which shifts the labels by one) never counts it. A row is ``(input_ids, attention_mask)`` and its
labels, as the causal-LM layers take them.

The stream (:class:`PackedBatches`) shuffles the rows once per epoch with a generator seeded by
(seed, epoch), so its position is the number of batches drawn, and resuming regenerates it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

EOS = 256           # ends every document
VOCAB = 257         # the byte ids and EOS
IGNORE = -100       # the label of padding (CausalLMLoss's ignore_index)


def encode(text: str) -> list[int]:
    """A document's ids: its UTF-8 bytes, then EOS."""
    return [*text.encode("utf-8"), EOS]


def decode(ids: Sequence[int]) -> str:
    """Ids back to text (EOS ends a document; undecodable bytes are replaced)."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def pack(documents: Sequence[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)``, each (rows, seq_len), of `documents` packed as the
    module docstring says."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (a token and the next to predict), got {seq_len}")
    rows: list[list[int]] = []
    row: list[int] = []
    for document in documents:
        ids = encode(document)
        if len(row) + len(ids) > seq_len and row:
            rows.append(row)
            row = []
        while len(ids) > seq_len:
            rows.append(ids[:seq_len])
            ids = ids[seq_len:]
        row += ids
    if row:
        rows.append(row)
    input_ids = torch.full((len(rows), seq_len), EOS, dtype=torch.long)
    mask = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    labels = input_ids.masked_fill(mask == 0, IGNORE)
    return input_ids, mask, labels


class PackedBatches:
    """Endless mini-batches of `batch_size` packed rows, reshuffled every epoch (see the module
    docstring); the last rows of an epoch that do not fill a batch wait for the next epoch's order."""

    def __init__(self, rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch_size: int,
                 seed: int) -> None:
        count = rows[0].shape[0]
        if batch_size < 1 or count < batch_size:
            raise ValueError(f"the text packs into {count} training rows, fewer than a mini-batch of "
                             f"{batch_size}: give more text, a shorter --seq-len, or a smaller --batch-size")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.batches_per_epoch = count // batch_size
        self.drawn = 0
        self._order: torch.Tensor | None = None
        self._epoch = -1

    def _indices(self, n: int) -> torch.Tensor:
        epoch, position = divmod(n, self.batches_per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order, self._epoch = torch.randperm(self.rows[0].shape[0], generator=g), epoch
        assert self._order is not None
        return self._order[position * self.batch_size:(position + 1) * self.batch_size]

    def __iter__(self) -> PackedBatches:
        return self

    def __next__(self) -> tuple[Any, Any]:
        chosen = self._indices(self.drawn)
        self.drawn += 1
        ids, mask, labels = (t[chosen] for t in self.rows)
        return (ids, mask), labels

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = int(state["drawn"])
