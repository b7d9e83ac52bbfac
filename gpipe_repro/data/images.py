"""Image classification data: load a dataset by name (`load_image_dataset`), and every image-data name.

The pieces live in modules of one responsibility (this module re-exports their public names, so
`from gpipe_repro.data.images import ...` keeps working):

- `image_dataset.py`: `ImageDataset` (one split in memory, [0, 1] batches, normalization),
  `ImageSplits`, the stratified train/test split and the per-channel statistics;
- `image_sources.py`: the offline datasets (`mnist-sample`, `digits`) and image folders;
- `image_hub.py`: Hugging Face hub datasets (`cifar10`, `cifar100`, `hub:<repo id>`);
- `image_batches.py`: `BatchIterator`, the seeded batch loader that resumes exactly;
- `augment.py`: augmentation on [0, 1] batches (between `ImageDataset.batch` and `normalize`).
"""
from __future__ import annotations

import os

from gpipe_repro.data.image_batches import BatchIterator
from gpipe_repro.data.image_dataset import (
    NORMALIZATION,
    DatasetUnavailableError,
    ImageDataset,
    ImageSplits,
    channel_stats,
    split_in_memory,
    stratified_split,
)
from gpipe_repro.data.image_hub import HUB_ALIASES, hub_offline, hub_splits, load_hub_dataset
from gpipe_repro.data.image_sources import (
    IMAGE_EXTENSIONS,
    OFFLINE_DATASETS,
    load_image_folder,
    mnist_sample,
    sklearn_digits,
)

__all__ = ["BatchIterator", "DatasetUnavailableError", "HUB_ALIASES", "IMAGE_EXTENSIONS", "ImageDataset",
           "ImageSplits", "NORMALIZATION", "OFFLINE_DATASETS", "channel_stats", "hub_offline", "hub_splits",
           "load_hub_dataset", "load_image_dataset", "load_image_folder", "stratified_split"]


def load_image_dataset(name: str, *, image_size: int | None = None, test_fraction: float = 0.2,
                       split_seed: int = 0, cache_dir: str | os.PathLike[str] | None = None
                       ) -> ImageSplits:
    """Train and test splits of a dataset by name.

    Offline: "mnist-sample", "digits". Hub (network or cache): "cifar10", "cifar100",
    "hub:<repo id>". Files: "folder:<root>". `image_size` makes `batch` return square images of that
    size (bilinear; upsampling 8x8 digits for a conv stem, for instance). `test_fraction` and
    `split_seed` apply where the source has no test split of its own.
    """
    if name == "mnist-sample":
        pixels, labels = mnist_sample()
        return split_in_memory(name, pixels, labels, tuple(map(str, range(10))), 255.0, image_size,
                                test_fraction, split_seed)
    if name == "digits":
        pixels, labels = sklearn_digits()
        return split_in_memory(name, pixels, labels, tuple(map(str, range(10))), 16.0, image_size,
                                test_fraction, split_seed)
    if name in HUB_ALIASES:
        repo, image_column, label_column = HUB_ALIASES[name]
        return load_hub_dataset(repo, image_column=image_column, label_column=label_column,
                                image_size=image_size, test_fraction=test_fraction,
                                split_seed=split_seed, cache_dir=cache_dir, name=name)
    if name.startswith("hub:"):
        return load_hub_dataset(name[len("hub:"):], image_size=image_size, test_fraction=test_fraction,
                                split_seed=split_seed, cache_dir=cache_dir)
    if name.startswith("folder:"):
        return load_image_folder(name[len("folder:"):], image_size=image_size,
                                 test_fraction=test_fraction, split_seed=split_seed)
    raise ValueError(f"unknown image dataset {name!r}: use one of {list(OFFLINE_DATASETS)} (offline), "
                     f"{list(HUB_ALIASES)} or 'hub:<repo id>' (Hugging Face hub), or 'folder:<root>'")
