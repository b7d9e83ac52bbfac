"""A model family with its training batch and loss, as the planner needs them (shapes only).

The command line names models as ``gpipe-repro models`` does (family + builder options); memory also
depends on what a training step feeds them: token ids of ``seq_len`` for the language models, images
of ``image_size`` for AmoebaNet, with the paper's batch sizes by default. Models are built on the
meta device, so even Transformer-1663 (84B parameters) costs seconds and no memory.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe_repro.paper import TABLE1_AMOEBANET, TABLE1_TRANSFORMER


@dataclass
class MemoryWorkload:
    """Layers (meta), a mini-batch and targets (meta), and the loss."""

    family: str
    options: dict[str, Any]
    layers: list[nn.Module]
    sample: torch.Tensor
    target: torch.Tensor
    loss_fn: Callable[[Any, Any], torch.Tensor]

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return (f"{self.family}({opts}), batch {tuple(self.sample.shape)} "
                f"{str(self.sample.dtype).replace('torch.', '')}")


SUPPORTED = ("transformer-lm", "amoebanet-d", "amoebanet-b", "gpt2")


def _ids(batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(batch, seq_len, dtype=torch.long, device="meta"),
            torch.empty(batch, seq_len, dtype=torch.long, device="meta"))


def workload(family: str, batch: int | None = None, **options: Any) -> MemoryWorkload:
    """Build `family` with `options` on the meta device, with its batch (see the module docstring).

    Extra options: ``seq_len`` (language models, default 1024) and ``image_size`` (AmoebaNet,
    default 224)."""
    from gpipe_repro.models import build
    if family not in SUPPORTED:
        raise ValueError(f"the memory planner's command line supports {', '.join(SUPPORTED)}, not "
                         f"{family!r}; for other models use gpipe_repro.memory.MemoryPlanner in Python "
                         "with the model's layers, a sample batch and the loss")
    options = dict(options)
    if family == "transformer-lm":
        from gpipe_repro.models.transformer_lm import lm_loss
        seq_len = int(options.pop("seq_len", TABLE1_TRANSFORMER["seq_len"]))
        n = batch or TABLE1_TRANSFORMER["batch"]
        sample, target = _ids(n, seq_len)
        loss: Callable[[Any, Any], torch.Tensor] = lm_loss
        shown = {**options, "seq_len": seq_len}
    elif family == "gpt2":
        from gpipe_repro.models.transformer_lm import lm_loss
        seq_len = int(options.pop("seq_len", 1024))
        n = batch or 8
        sample, target = _ids(n, seq_len)
        loss = lm_loss
        shown = {**options, "seq_len": seq_len}
    else:
        from gpipe_repro.models.amoebanet import amoebanet_loss
        size = int(options.get("image_size", TABLE1_AMOEBANET["image_size"]))
        options["image_size"] = size
        n = batch or TABLE1_AMOEBANET["batch"]
        sample = torch.empty(n, options.get("in_channels", 3), size, size, device="meta")
        target = torch.empty(n, dtype=torch.long, device="meta")
        loss = amoebanet_loss
        shown = dict(options)
    with torch.device("meta"):
        layers = list(build(family, **options))
    return MemoryWorkload(family, shown, layers, sample, target, loss)


__all__ = ["MemoryWorkload", "workload", "SUPPORTED"]
