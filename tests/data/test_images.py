"""Image datasets (offline, hub conversion, folders), the resumable batch iterator, augmentation."""
from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from gpipe_repro.data.augment import Augmentation, cutout, default_augmentation, random_crop, random_flip
from gpipe_repro.data.images import (
    NORMALIZATION,
    BatchIterator,
    DatasetUnavailableError,
    ImageDataset,
    channel_stats,
    hub_splits,
    load_image_dataset,
    load_image_folder,
    stratified_split,
)


@pytest.fixture(scope="module")
def mnist() -> tuple[ImageDataset, ImageDataset]:
    return load_image_dataset("mnist-sample")


@pytest.fixture(scope="module")
def digits() -> tuple[ImageDataset, ImageDataset]:
    return load_image_dataset("digits")


# ----------------------------------------------------------------------------- offline datasets

@pytest.mark.parametrize("name, size, side, levels",
                         [("mnist-sample", 5000, 28, 256), ("digits", 1797, 8, 17)])
def test_offline_datasets_shapes_dtypes_labels(name: str, size: int, side: int, levels: int) -> None:
    train, test = load_image_dataset(name)
    assert len(train) + len(test) == size and len(test) == pytest.approx(0.2 * size, abs=10)
    for split in (train, test):
        x, y = split.batch(torch.arange(len(split)))
        assert x.shape == (len(split), 1, side, side) and x.dtype == torch.float32
        assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
        assert x.min() >= 0.0 and x.max() == 1.0
        assert len(torch.unique(x)) <= levels and split.num_classes == 10
    # stratified: every class keeps its share in both splits
    share = torch.bincount(test.labels) / (torch.bincount(train.labels) + torch.bincount(test.labels))
    assert share.min() > 0.19 and share.max() < 0.21


def test_split_is_fixed_disjoint_and_reproducible(mnist: tuple[ImageDataset, ImageDataset]) -> None:
    labels = torch.arange(100) % 4
    train, test = stratified_split(labels, 0.25, seed=0)
    assert set(train.tolist()).isdisjoint(test.tolist()) and len(train) + len(test) == 100
    assert torch.bincount(labels[test]).tolist() == [6, 6, 6, 6]  # round(25 * 0.25) of each class
    again = load_image_dataset("mnist-sample")
    assert torch.equal(again.train.pixels, mnist[0].pixels)
    assert torch.equal(again.test.labels, mnist[1].labels)
    other = load_image_dataset("mnist-sample", split_seed=1)
    assert not torch.equal(other.test.pixels, mnist[1].pixels)


def test_normalization_constants_match_the_train_split(mnist: tuple[ImageDataset, ImageDataset],
                                                       digits: tuple[ImageDataset, ImageDataset]) -> None:
    for train, test in (mnist, digits):
        mean, std = channel_stats(train.pixels, train.pixel_scale)
        assert np.allclose(mean, NORMALIZATION[train.name][0], atol=2e-4)
        assert np.allclose(std, NORMALIZATION[train.name][1], atol=2e-4)
        assert (test.mean, test.std) == (train.mean, train.std)  # test uses the train statistics
        x = train.normalize(train.batch(torch.arange(len(train)))[0])
        assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1) < 1e-3


def test_digits_are_scikit_learns_digits() -> None:
    from sklearn.datasets import load_digits

    from gpipe_repro.data.image_sources import sklearn_digits  # the fast path that skips importing sklearn

    pixels, labels = sklearn_digits()
    reference = load_digits()
    assert torch.equal(pixels[:, 0], torch.from_numpy(reference.images).to(torch.uint8))
    assert torch.equal(labels, torch.from_numpy(reference.target))


def test_upsampled_digits(digits: tuple[ImageDataset, ImageDataset]) -> None:
    up = load_image_dataset("digits", image_size=32).train
    x, y = up.batch([0, 1, 2])
    assert x.shape == (3, 1, 32, 32) and up.shape == (1, 32, 32)
    assert torch.equal(y, digits[0].labels[:3])
    assert x.min() >= 0 and x.max() <= 1
    small, _ = digits[0].batch([0, 1, 2])
    down = torch.nn.functional.adaptive_avg_pool2d(x, 8)  # upsampling preserves the coarse image
    assert (down - small).abs().mean() < 0.1


def test_unknown_dataset_names_the_choices() -> None:
    with pytest.raises(ValueError, match="mnist-sample"):
        load_image_dataset("imagenet")


# ----------------------------------------------------------------------------- hub and folders

def test_hub_dataset_offline_fails_fast_and_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the test touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DatasetUnavailableError) as info:
        load_image_dataset("cifar10", cache_dir=tmp_path / "empty-cache")
    message = str(info.value)
    assert "uoft-cs/cifar10" in message and "offline" in message
    assert "'mnist-sample'" in message and "'digits'" in message

    # Not in offline mode but no route to the hub: refuse at once rather than wait on retries.
    from gpipe_repro.data import image_hub

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(image_hub, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(DatasetUnavailableError, match=r"unreachable.*'mnist-sample'"):
        load_image_dataset("hub:someone/pets")


def test_hub_splits_converts_image_and_class_label_columns() -> None:
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)
    features = datasets.Features({"img": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["cat", "dog"])})

    def split(n: int) -> datasets.Dataset:
        images = [Image.fromarray(rng.integers(0, 256, (5, 5, 3), dtype=np.uint8)) for _ in range(n)]
        labels = [i % 2 for i in range(n)]
        return datasets.Dataset.from_dict({"img": images, "label": labels}, features=features)

    dd = datasets.DatasetDict({"train": split(6), "test": split(4)})
    train, test = hub_splits(dd, name="hub:toy")
    assert train.pixels.shape == (6, 3, 5, 5) and train.pixels.dtype == torch.uint8
    assert torch.equal(train.pixels[0].permute(1, 2, 0), torch.from_numpy(np.array(dd["train"][0]["img"])))
    assert train.class_names == ("cat", "dog") and test.labels.tolist() == [0, 1, 0, 1]
    assert train.mean == channel_stats(train.pixels, 255.0)[0] == test.mean
    only_train = hub_splits(datasets.DatasetDict({"train": split(10)}), name="hub:toy", test_fraction=0.2)
    assert (len(only_train.train), len(only_train.test)) == (8, 2)
    plain = split(4).cast_column("label", datasets.Value("int64")).map(
        lambda row: {"species": ["owl", "bee"][row["label"]]})
    named = hub_splits(datasets.DatasetDict({"train": plain}), name="hub:toy", label_column="species",
                       test_fraction=0.5)
    assert named.train.class_names == ("bee", "owl")
    assert sorted(named.train.labels.tolist() + named.test.labels.tolist()) == [0, 0, 1, 1]


def write_png(path: Path, value: int, size: tuple[int, int] = (6, 4), mode: str = "RGB") -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    Image.fromarray(np.full(shape, value, dtype=np.uint8)).save(path)


def test_image_folder_with_and_without_split_dirs(tmp_path: Path) -> None:
    for i in range(5):
        write_png(tmp_path / "flat" / "bird" / f"{i}.png", 10 * i)
        write_png(tmp_path / "flat" / "ant" / f"{i}.png", 200)
    (tmp_path / "flat" / "notes.txt").write_text("ignored")
    train, test = load_image_dataset(f"folder:{tmp_path / 'flat'}", test_fraction=0.4)
    assert train.class_names == ("ant", "bird") and (len(train), len(test)) == (6, 4)
    assert train.pixels.shape[1:] == (3, 4, 6)
    assert train.pixels[train.labels == 0].eq(200).all()

    for i in range(3):
        write_png(tmp_path / "split" / "train" / "a" / f"{i}.png", 1, size=(8, 8), mode="L")
        write_png(tmp_path / "split" / "train" / "b" / f"{i}.png", 2, size=(10, 12), mode="L")
    write_png(tmp_path / "split" / "val" / "b" / "0.png", 3, size=(8, 8), mode="L")
    with pytest.raises(ValueError, match="image_size"):
        load_image_folder(tmp_path / "split")
    train, test = load_image_folder(tmp_path / "split", image_size=4)
    assert train.pixels.shape == (6, 1, 4, 4) and test.pixels.shape == (1, 1, 4, 4)
    assert test.labels.tolist() == [1] and test.pixels.eq(3).all()
    with pytest.raises(FileNotFoundError):
        load_image_folder(tmp_path / "nope")


# ----------------------------------------------------------------------------- batch iterator

def test_every_epoch_is_a_seeded_permutation(digits: tuple[ImageDataset, ImageDataset]) -> None:
    train = digits[0]
    it = BatchIterator(train, 100, seed=3)
    per_epoch = it.batches_per_epoch
    assert per_epoch == len(train) // 100
    seen = [it.order(e)[: per_epoch * 100] for e in range(2)]
    assert not torch.equal(seen[0], seen[1])
    assert torch.equal(torch.sort(it.order(0)).values, torch.arange(len(train)))
    labels = torch.cat([next(it)[1] for _ in range(per_epoch)])
    assert torch.equal(labels, train.labels[seen[0]])
    assert it.position == (0, per_epoch)
    next(it)
    assert it.position == (1, 1)
    same_seed = BatchIterator(train, 100, seed=3)
    assert torch.equal(next(same_seed)[0], train.batch(seen[0][:100])[0])


def test_resume_at_a_position_yields_the_remaining_batches(mnist: tuple[ImageDataset, ImageDataset]) -> None:
    train = mnist[0]
    full = BatchIterator(train, 512, seed=11)  # 7 batches per epoch: the span crosses an epoch
    for _ in range(5):
        next(full)
    state = full.state_dict()
    expected = [next(full) for _ in range(6)]
    resumed = BatchIterator(train, 512, seed=11)
    resumed.load_state_dict(state)
    for (x0, y0), (x1, y1) in zip(expected, (next(resumed) for _ in range(6))):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    wrong = BatchIterator(train, 256, seed=11)
    with pytest.raises(ValueError, match="batch_size"):
        wrong.load_state_dict(state)


def test_finite_unshuffled_pass_keeps_the_last_partial_batch(
        digits: tuple[ImageDataset, ImageDataset]) -> None:
    test = digits[1]
    batches = list(test.batches(100, shuffle=False, drop_last=False, epochs=1))
    assert [len(y) for _, y in batches] == [100, 100, 100, len(test) - 300]
    assert torch.equal(torch.cat([y for _, y in batches]), test.labels)
    with pytest.raises(ValueError, match="no batch"):
        BatchIterator(test, len(test) + 1)


# ----------------------------------------------------------------------------- augmentation

def test_crop_is_a_translation_of_the_zero_padded_image() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(16, 3, 8, 8)
    out = random_crop(x, 2, g)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    offsets = set()
    for i in range(16):
        matches = [(dy, dx) for dy in range(5) for dx in range(5)
                   if torch.equal(out[i], padded[i, :, dy:dy + 8, dx:dx + 8])]
        assert matches, f"image {i} is not a crop of its padded version"
        offsets.add(matches[0])
    assert len(offsets) > 3
    assert torch.equal(random_crop(x, 0, g), x)


def test_flip_mirrors_some_images_and_keeps_the_rest() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 1, 5, 5)
    out = random_flip(x, g)
    same = [torch.equal(o, i) for o, i in zip(out, x)]
    mirrored = [torch.equal(o, i.flip(-1)) for o, i in zip(out, x)]
    assert all(s or m for s, m in zip(same, mirrored))
    assert 16 < sum(mirrored) < 48


def test_cutout_fills_one_square_per_image() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(200, 3, 12, 12) + 1.0  # never equal to the fill
    out = cutout(x, 4, g, fill=(0.1, 0.2, 0.3))
    filled = (out != x)
    assert torch.equal(filled[:, 0], filled[:, 2])  # same square on every channel
    areas = filled[:, 0].sum(dim=(1, 2))
    assert areas.max() == 16 and areas.min() >= 4 and (areas == 16).any() and (areas < 16).any()
    assert torch.allclose(out[:, 1][filled[:, 1]], torch.tensor(0.2))


def test_augmentation_is_deterministic_and_checkpointable(mnist: tuple[ImageDataset, ImageDataset]) -> None:
    x, _ = mnist[0].batch(torch.arange(32))
    a, b = Augmentation(crop_padding=2, flip=True, cutout_size=8, seed=5), \
        Augmentation(crop_padding=2, flip=True, cutout_size=8, seed=5)
    assert torch.equal(a(x), b(x)) and not torch.equal(a(x), x)
    assert not torch.equal(Augmentation(crop_padding=2, cutout_size=8, seed=6)(x),
                           Augmentation(crop_padding=2, cutout_size=8, seed=7)(x))
    torch.manual_seed(0)
    state = a.state_dict()
    expected = a(x)
    torch.manual_seed(1)  # the global stream does not matter
    a(x)
    a.load_state_dict(state)
    assert torch.equal(a(x), expected)
    with pytest.raises(ValueError, match="augmentation"):
        Augmentation(seed=5).load_state_dict(state)


def test_default_augmentation_keeps_digits_unflipped() -> None:
    digits = default_augmentation("mnist-sample", 28, mean=(0.13,))
    natural = default_augmentation("cifar10", 32, mean=(0.49, 0.48, 0.45))
    assert not digits.flip and natural.flip
    assert (natural.crop_padding, natural.cutout_size) == (4, 16)
    x = torch.rand(4, 3, 32, 32)
    assert natural(x).shape == x.shape


def test_every_name_the_images_module_had_is_still_importable_from_it() -> None:
    """data/images.py re-exports the public names of its image_*.py modules."""
    from gpipe_repro.data import image_batches, image_dataset, image_hub, image_sources, images
    homes = {"BatchIterator": image_batches, "DatasetUnavailableError": image_dataset,
             "ImageDataset": image_dataset, "ImageSplits": image_dataset, "NORMALIZATION": image_dataset,
             "channel_stats": image_dataset, "stratified_split": image_dataset, "HUB_ALIASES": image_hub,
             "hub_offline": image_hub, "hub_splits": image_hub, "load_hub_dataset": image_hub,
             "IMAGE_EXTENSIONS": image_sources, "OFFLINE_DATASETS": image_sources,
             "load_image_folder": image_sources}
    for name, home in homes.items():
        assert getattr(images, name) is getattr(home, name), name
    assert set(images.__all__) == {*homes, "load_image_dataset"}
