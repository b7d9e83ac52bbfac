"""Image augmentation on whole batches of tensors, driven by an explicit torch.Generator.

What the paper used: its transfer experiments fine-tune with "random flip + cutout"; the standard
CIFAR recipe adds a random crop from a zero-padded image. All three are here, vectorized over the
batch (one gather / one `where`, no Python loop per image), on any device.

Why an explicit generator. The engine seeds the default generators before every layer on every
micro-batch (`gpipe_repro/engine/rng.py`); augmentation drawing from the default stream would both disturb
that and be disturbed by it. `Augmentation` owns a `torch.Generator` (on the CPU: random parameters are
drawn there, then moved to the batch's device, so the stream is the same on CPU and GPU) and exposes
`state_dict()` / `load_state_dict()`, so a checkpoint resumes the augmentation stream exactly.

Order and fill values. Apply to [0, 1] images from `ImageDataset.batch`, then normalize:
crop pads with 0 (black, as zero-padding a raw image does), cutout fills with the dataset mean, which
is exactly 0 after normalization (where DeVries & Taylor 2017 apply their zero patch).

Why flips are off for digits (`default_augmentation`): a mirrored digit is a different glyph or none
(2 vs a reversed S-like shape, 3 vs E, 7 and 9 become non-digits), so flipping adds label noise
instead of invariance. Natural images (CIFAR, ImageNet) keep their label under a horizontal flip.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

DIGIT_DATASETS = ("mnist-sample", "digits")


def random_crop(x: torch.Tensor, padding: int, generator: torch.Generator, fill: float = 0.0
                ) -> torch.Tensor:
    """Pad every image by `padding` on each side with `fill`, then crop back to (H, W) at an offset
    drawn per image."""
    if padding <= 0:
        return x
    b, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding), value=fill)
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(x.device)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]   # (B, 1, H, 1)
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, None, :]   # (B, 1, 1, W)
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    channel = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, channel, rows, cols]


def random_flip(x: torch.Tensor, generator: torch.Generator, p: float = 0.5) -> torch.Tensor:
    """Mirror each image left-right with probability `p`."""
    flip = (torch.rand(x.shape[0], generator=generator) < p).to(x.device)
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def cutout(x: torch.Tensor, size: int, generator: torch.Generator,
           fill: float | Sequence[float] = 0.0) -> torch.Tensor:
    """Fill one `size` x `size` square per image with `fill` (a value or one per channel).

    The square's center is uniform over the image and the square is clipped at the borders
    (DeVries & Taylor 2017), so some images lose less than size^2 pixels.
    """
    if size <= 0:
        return x
    b, c, h, w = x.shape
    cy = torch.randint(0, h, (b,), generator=generator).to(x.device)
    cx = torch.randint(0, w, (b,), generator=generator).to(x.device)
    top, left = cy - size // 2, cx - size // 2
    ys = torch.arange(h, device=x.device)
    xs = torch.arange(w, device=x.device)
    inside_y = (ys[None, :] >= top[:, None]) & (ys[None, :] < top[:, None] + size)     # (B, H)
    inside_x = (xs[None, :] >= left[:, None]) & (xs[None, :] < left[:, None] + size)   # (B, W)
    mask = (inside_y[:, :, None] & inside_x[:, None, :])[:, None]                      # (B, 1, H, W)
    value = torch.as_tensor(fill, dtype=x.dtype, device=x.device).reshape(1, -1, 1, 1)
    if value.shape[1] not in (1, c):
        raise ValueError(f"cutout fill has {value.shape[1]} values for {c} channels")
    return torch.where(mask, value, x)


class Augmentation:
    """Crop (zero padding), flip and cutout for [0, 1] image batches, with its own generator.

        augment = default_augmentation("cifar10", image_size=32, mean=train.mean, seed=0)
        x = train.normalize(augment(x))
    """

    def __init__(self, *, crop_padding: int = 0, flip: bool = False, cutout_size: int = 0,
                 cutout_fill: float | Sequence[float] = 0.0, seed: int = 0) -> None:
        self.crop_padding, self.flip, self.cutout_size = crop_padding, flip, cutout_size
        self.cutout_fill = cutout_fill
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4:
            raise ValueError(f"augmentation needs a (B, C, H, W) batch, got shape {tuple(x.shape)}")
        if self.crop_padding:
            x = random_crop(x, self.crop_padding, self.generator)
        if self.flip:
            x = random_flip(x, self.generator)
        if self.cutout_size:
            x = cutout(x, self.cutout_size, self.generator, self.cutout_fill)
        return x

    def config(self) -> dict[str, Any]:
        return {"crop_padding": self.crop_padding, "flip": self.flip, "cutout_size": self.cutout_size,
                "cutout_fill": list(self.cutout_fill) if isinstance(self.cutout_fill, Sequence)
                else self.cutout_fill, "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "config": self.config()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["config"] != self.config():
            raise ValueError(f"the saved augmentation was {state['config']}, this one is "
                             f"{self.config()}: resume with the run's original augmentation settings")
        self.generator.set_state(state["generator"].cpu())

    def __repr__(self) -> str:
        return f"Augmentation({', '.join(f'{k}={v}' for k, v in self.config().items())})"


def default_augmentation(dataset: str, image_size: int, *, mean: Sequence[float] = (0.0,),
                         seed: int = 0, flip: bool | None = None, cutout_size: int | None = None
                         ) -> Augmentation:
    """The usual recipe scaled to the image size: crop padding size/8 (4 px at 32), cutout half the
    side for natural images (16 px at 32, the CIFAR-10 setting of DeVries & Taylor) and a quarter for
    digits, flips only for natural images (see the module docstring). `mean` is the cutout fill."""
    digits = dataset in DIGIT_DATASETS
    return Augmentation(
        crop_padding=max(1, image_size // 8),
        flip=(not digits) if flip is None else flip,
        cutout_size=(image_size // 4 if digits else image_size // 2) if cutout_size is None else cutout_size,
        cutout_fill=tuple(mean),
        seed=seed,
    )
