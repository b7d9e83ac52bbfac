"""One split of an image classification dataset in memory, and how splits are made and normalized.

What a dataset is (`ImageDataset`): native-resolution pixels (uint8 when the source is 8-bit, so
CIFAR-sized data stays small), int64 labels, class names and per-channel normalization statistics of
the TRAIN split (the test split is normalized with the same numbers). `dataset.batch(indices)` returns
float32 (B, C, H, W) in [0, 1], resized to `image_size` if one was asked for; `dataset.normalize(x)`
maps that to zero mean / unit variance. Augmentation (`gpipe_repro/data/augment.py`) runs between the
two, on [0, 1] images.

Sources without a test split of their own get a fixed, stratified train/test split (`stratified_split`:
a seeded permutation within each class), so test accuracy means the same thing in every run. Where the
sources come from: `gpipe_repro/data/image_sources.py` (offline, folders) and `image_hub.py`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from gpipe_repro.data.image_batches import BatchIterator

# Per-channel (mean, std) on the [0, 1] scale of each dataset's train split at native resolution.
# mnist-sample and digits are computed on this module's fixed split (tests recompute them);
# CIFAR's are the usual published values. Any other dataset's are computed when it is loaded.
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist-sample": ((0.1311,), (0.3083,)),
    "digits": ((0.3055,), (0.3761,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}

class DatasetUnavailableError(RuntimeError):
    """The dataset needs a download that cannot happen here (offline, no cache)."""


@dataclasses.dataclass
class ImageDataset:
    """One split of an image classification dataset, held in memory."""

    name: str
    split: str
    pixels: torch.Tensor          # (N, C, H, W), uint8 or float32, native resolution
    labels: torch.Tensor          # (N,) int64 in [0, num_classes)
    class_names: tuple[str, ...]
    mean: tuple[float, ...]       # per channel, train split, [0, 1] scale
    std: tuple[float, ...]
    pixel_scale: float = 255.0    # pixels / pixel_scale lies in [0, 1]
    image_size: int | None = None  # square output size of `batch`; None keeps the native size

    def __post_init__(self) -> None:
        if self.pixels.ndim != 4:
            raise ValueError(f"pixels must be (N, C, H, W), got shape {tuple(self.pixels.shape)}")
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.pixels.shape[0],):
            raise ValueError("labels must be int64 with one label per image")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"mean/std need {self.channels} channels, got {len(self.mean)}/{len(self.std)}")

    def __len__(self) -> int:
        return self.pixels.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = self.batch(torch.tensor([i]))
        return x[0], int(y[0])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def channels(self) -> int:
        return self.pixels.shape[1]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the images `batch` returns."""
        h, w = self.pixels.shape[2:]
        return (self.channels, self.image_size or h, self.image_size or w)

    @property
    def images(self) -> torch.Tensor:
        """All images as float32 (N, C, H, W) in [0, 1] (materializes a float copy)."""
        return self.batch(torch.arange(len(self)))[0]

    def batch(self, indices: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Images `indices` as float32 (B, C, H, W) in [0, 1] and their int64 labels."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        x = self.pixels[idx].to(torch.float32) / self.pixel_scale
        if self.image_size is not None and tuple(x.shape[2:]) != (self.image_size, self.image_size):
            shrinking = min(x.shape[2:]) > self.image_size
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                              align_corners=False, antialias=shrinking).clamp_(0.0, 1.0)
        return x, self.labels[idx]

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """(x - mean) / std per channel, for [0, 1] images from `batch` (any device)."""
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        return (x - mean) / std

    def batches(self, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                drop_last: bool = True, epochs: int | None = None) -> BatchIterator:
        """A `BatchIterator` over this split (`gpipe_repro.data.image_batches`)."""
        from gpipe_repro.data.image_batches import BatchIterator
        return BatchIterator(self, batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last,
                             epochs=epochs)

    def info(self) -> dict[str, Any]:
        """A JSON-ready description for results files and run configs."""
        return {"name": self.name, "split": self.split, "size": len(self), "shape": list(self.shape),
                "num_classes": self.num_classes, "mean": list(self.mean), "std": list(self.std)}


class ImageSplits(NamedTuple):
    train: ImageDataset
    test: ImageDataset


def stratified_split(labels: torch.Tensor, test_fraction: float, seed: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, test indices): each class shuffled by `seed` and cut at `test_fraction`."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    y = labels.numpy()
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        n_test = round(len(members) * test_fraction)
        test.append(members[:n_test])
        train.append(members[n_test:])
    return torch.from_numpy(np.sort(np.concatenate(train))), torch.from_numpy(np.sort(np.concatenate(test)))


def channel_stats(pixels: torch.Tensor, pixel_scale: float, chunk: int = 4096
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of `pixels / pixel_scale` (float64 sums, chunked to bound memory)."""
    total = torch.zeros(pixels.shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for start in range(0, pixels.shape[0], chunk):
        x = pixels[start:start + chunk].to(torch.float64) / pixel_scale
        total += x.sum(dim=(0, 2, 3))
        squares += (x * x).sum(dim=(0, 2, 3))
    count = pixels.shape[0] * pixels.shape[2] * pixels.shape[3]
    mean = total / count
    std = (squares / count - mean * mean).clamp_min(0).sqrt()
    return tuple(round(float(m), 4) for m in mean), tuple(round(float(s), 4) for s in std)


def make_splits(name: str, train: tuple[torch.Tensor, torch.Tensor],
                test: tuple[torch.Tensor, torch.Tensor], class_names: tuple[str, ...],
                pixel_scale: float, image_size: int | None) -> ImageSplits:
    """Train and test `ImageDataset`s normalized with the train split's statistics (`NORMALIZATION`
    for the datasets with published ones, else `channel_stats` of the train pixels)."""
    mean, std = NORMALIZATION.get(name) or channel_stats(train[0], pixel_scale)
    def dataset(split: str, pixels: torch.Tensor, labels: torch.Tensor) -> ImageDataset:
        return ImageDataset(split=split, pixels=pixels, labels=labels, name=name, class_names=class_names,
                            mean=mean, std=std, pixel_scale=pixel_scale, image_size=image_size)
    return ImageSplits(dataset("train", *train), dataset("test", *test))


def split_in_memory(name: str, pixels: torch.Tensor, labels: torch.Tensor,
                    class_names: tuple[str, ...], pixel_scale: float, image_size: int | None,
                    test_fraction: float, split_seed: int) -> ImageSplits:
    """`make_splits` of one labelled pool cut by `stratified_split` (sources without a test split)."""
    train_idx, test_idx = stratified_split(labels, test_fraction, split_seed)
    return make_splits(name, (pixels[train_idx], labels[train_idx]),
                        (pixels[test_idx], labels[test_idx]), class_names, pixel_scale, image_size)
