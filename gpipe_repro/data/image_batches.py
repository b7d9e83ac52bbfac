"""The resumable batch loader of the image tasks.

Why a batch iterator of our own (`BatchIterator`). Its order is a pure function of (seed, epoch), and
its position is (epoch, index of the next batch): a checkpoint stores three integers and a resumed run
yields exactly the batches the interrupted one would have. It uses no global RNG, so it cannot disturb
the engine's per-layer seeding.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from gpipe_repro.data.image_dataset import ImageDataset


class BatchIterator:
    """Batches of (x, y) in an order fixed by (seed, epoch); position = (epoch, index).

    Iterates forever across epochs (the run loop counts steps) unless `epochs` is given.
    `state_dict()` / `load_state_dict()` save and restore the position: resuming at a position yields
    exactly the batches that remained.
    """

    def __init__(self, dataset: ImageDataset, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True, epochs: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > len(dataset):
            raise ValueError(f"batch_size {batch_size} > {len(dataset)} images in {dataset.name}/"
                             f"{dataset.split} with drop_last=True: no batch would ever be produced")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.shuffle, self.drop_last, self.epochs = shuffle, drop_last, epochs
        self.epoch, self.index = 0, 0
        self._order_epoch: int | None = None
        self._order = torch.empty(0, dtype=torch.long)

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, index of the next batch within it)."""
        return self.epoch, self.index

    def order(self, epoch: int) -> torch.Tensor:
        """The sample order of `epoch`: a permutation seeded by (seed, epoch), or 0..N-1."""
        if self._order_epoch != epoch:
            n = len(self.dataset)
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(n)
                self._order = torch.from_numpy(perm)
            else:
                self._order = torch.arange(n)
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        if self.epochs is not None and self.epoch >= self.epochs:
            raise StopIteration
        start = self.index * self.batch_size
        indices = self.order(self.epoch)[start:start + self.batch_size]
        self.index += 1
        return self.dataset.batch(indices)

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("seed", "batch_size", "shuffle", "drop_last", "dataset_size"):
            if state[key] != mine[key]:
                raise ValueError(f"the saved data position was made with {key}={state[key]}, this "
                                 f"iterator has {key}={mine[key]}: resuming would not reproduce the "
                                 "remaining batches; use the run's original data settings")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
