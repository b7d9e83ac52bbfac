"""The paper's models as layer sequences, by family name, and their sizes without allocating them.

Why a registry: the CLI, the experiments and the tests name models the way the paper does
("amoebanet-d", L=18, F=256) and need their parameter counts and memory (Table 1 goes to 83.9B
parameters). Every builder returns an ``nn.Sequential`` of pipeline layers; :func:`model_size`
builds it under ``torch.device("meta")``, so counting needs no memory and takes seconds.

    from gpipe_repro.models import build, model_size
    layers = build("amoebanet-d", L=18, F=256, num_classes=10)
    size = model_size("transformer-lm", L=1663)      # 83.9B parameters, nothing allocated
"""
from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.choices import did_you_mean
from gpipe_repro.models.amoebanet import amoebanet
from gpipe_repro.models.hf_gpt2 import gpt2
from gpipe_repro.models.transformer_lm import transformer_lm
from gpipe_repro.models.translation import translation_transformer

BYTES_PER_PARAM = 12   # fp32 weight + gradient + one RMSProp slot: the paper's Table 1 convention


@dataclass(frozen=True)
class ModelFamily:
    """A named builder with the paper's default size."""

    name: str
    builder: Callable[..., nn.Sequential]
    description: str
    defaults: dict[str, Any] = field(default_factory=dict)

    def options(self) -> dict[str, Any]:
        """Every keyword the builder takes, with the value used when none is given."""
        out: dict[str, Any] = {}
        fixed = getattr(self.builder, "keywords", {})     # what a functools.partial pins down
        for p in inspect.signature(self.builder).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in fixed:
                continue
            out[p.name] = self.defaults.get(p.name, None if p.default is p.empty else p.default)
        return out

    def build(self, **kwargs: Any) -> nn.Sequential:
        known = self.options()
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(f"{self.name} has no option {', '.join(unknown)}; its options are: "
                             f"{', '.join(known)}")
        for name, value in kwargs.items():
            check_option(self.name, name, value, known[name])
        return self.builder(**{**self.defaults, **kwargs})


def check_option(family: str, name: str, value: Any, default: Any) -> None:
    """Raise ValueError, naming the option, where `value` is not of its `default`'s kind: a size
    (an integer default) takes an integer >= 1 (>= 0 where the default is 0), a float default a
    number, a flag true or false, a text default text (an option whose default is None: anything)."""
    option = f"--{name.replace('_', '-')}"
    if isinstance(default, bool):
        ok, wanted = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        low = 0 if default == 0 else 1
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        wanted = f"an integer >= {low}"
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        wanted = "a number"
    elif isinstance(default, str):
        ok, wanted = isinstance(value, str), "a text"
    else:
        return
    if not ok:
        raise ValueError(f"{option} takes {wanted} for {family} (default {default!r}), got {value!r}")


FAMILIES: dict[str, ModelFamily] = {f.name: f for f in [
    ModelFamily("amoebanet-d", functools.partial(amoebanet, genotype="D"),
                "AmoebaNet-D(L, F): image classifier of Tables 1-3 (L normal cells, F filters); "
                "with its auxiliary head, as counted in Table 1",
                {"L": 18, "F": 256, "aux_head": True}),
    ModelFamily("amoebanet-b", functools.partial(amoebanet, genotype="B"),
                "AmoebaNet-B(L, F): the ImageNet / transfer-learning model of Table 4 (557M without "
                "the auxiliary head)",
                {"L": 18, "F": 512}),
    ModelFamily("transformer-lm", transformer_lm,
                "Transformer-L: decoder-only LM of Tables 1-3 (d 2048, ff 8192, 32 heads, 32k vocab)",
                {"L": 48}),
    ModelFamily("transformer-t", translation_transformer,
                "T(L, H, A): encoder-decoder translation model (d 1024, 64 channels per head)",
                {"L": 6, "H": 8192, "A": 16}),
    ModelFamily("gpt2", gpt2,
                "GPT-2 from a transformers GPT2Config (random init, no download); GPT-2 small default",
                {}),
]}


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        close = did_you_mean(name, FAMILIES)
        raise ValueError(f"unknown model family {name!r}{close or ';'} choose one of "
                         f"{', '.join(FAMILIES)}, or a Hugging Face causal LM as hf:<model_type> "
                         "(e.g. hf:llama) or hf:path/to/config.json")
    return FAMILIES[name]


def build(family: str, **kwargs: Any) -> nn.Sequential:
    """Build a family's layer sequence (real weights, on the current default device)."""
    return get_family(family).build(**kwargs)


@dataclass(frozen=True)
class ModelSize:
    """Per-layer and total parameter counts. Weights shared by two layers count once in `total`."""

    layers: list[tuple[str, str, int]]     # (name, class name, parameters incl. shared ones)
    total: int
    shared: int                            # parameters held by more than one layer

    @property
    def bytes(self) -> int:
        return self.total * BYTES_PER_PARAM


def count_layers(layers: nn.Sequential) -> ModelSize:
    """Count the parameters of each layer of `layers` (any device, meta included)."""
    rows: list[tuple[str, str, int]] = []
    owners: dict[int, int] = {}
    for name, layer in layers.named_children():
        rows.append((name, type(layer).__name__, sum(p.numel() for p in layer.parameters())))
        for p in layer.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    unique = {id(p): p for p in layers.parameters()}
    total = sum(p.numel() for p in unique.values())
    shared = sum(p.numel() for i, p in unique.items() if owners.get(i, 0) > 1)
    return ModelSize(rows, total, shared)


def model_size(family: str, **kwargs: Any) -> ModelSize:
    """Build `family` on the meta device (no memory) and count its parameters."""
    with torch.device("meta"):
        layers = build(family, **kwargs)
    return count_layers(layers)


__all__ = ["BYTES_PER_PARAM", "FAMILIES", "ModelFamily", "ModelSize", "build", "check_option", "count_layers",
           "get_family", "model_size"]
