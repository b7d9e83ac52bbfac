"""A model and its inputs, described as data: the one workload type.

The throughput sweep, the simulator's calibration, the CI speedup baseline and the memory planner all
describe "a model of the registry (:mod:`gpipe_repro.models`), fed batches of this shape, trained
with this loss" with this one frozen, hashable type, so a calibration can be cached by it and rebuilt
in another process, and the planner can build the same model on ``meta``. ``batch`` is the
mini-batch a memory plan assumes (None where the caller picks the sizes, as calibration does).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.models import build, get_family
from gpipe_repro.models.amoebanet import amoebanet_loss
from gpipe_repro.models.transformer_lm import lm_loss

KINDS = ("image", "tokens", "features")
"""What a workload is fed: ``image`` (float images, class targets, AmoebaNet's loss), ``tokens``
(token ids, next-token targets, the language-model loss), ``features`` (float inputs of any shape,
class targets, cross-entropy): the kind for a user's own model."""


def _factory(spec: str) -> Callable[..., Any]:
    """The callable named by ``"package.module:function"`` (imported here; nothing is built)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"a model factory is given as 'module:function', got {spec!r}")
    try:
        module = _import_here_too(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for the model factory {spec!r}: {e}; "
                         "is it on PYTHONPATH (or in the current directory)?") from e
    if not hasattr(module, attr):
        raise ValueError(f"{module_name!r} has no function {attr!r} (model factory {spec!r})")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"{module_name}.{attr} ({type(fn).__name__}) is not a function: the model "
                         f"factory {spec!r} must name a function returning the model's layers")
    return fn


def _import_here_too(module_name: str) -> Any:
    """`module_name` imported, from the current directory too: the `gpipe-repro` command, unlike
    `python -m`, does not put it on the path, and a user's model file usually sits there."""
    try:
        return importlib.import_module(module_name)
    except ImportError:
        here = os.getcwd()
        if here in sys.path or "" in sys.path:
            raise
        sys.path.insert(0, here)
        return importlib.import_module(module_name)


def _factory_source_hash(spec: str) -> str:
    """A digest of the factory module's source: a calibration cached for one version of a user's
    model is not reused for another."""
    module = _import_here_too(spec.partition(":")[0])
    try:
        text = inspect.getsource(module)
    except (OSError, TypeError):
        return "unknown"
    return hashlib.sha1(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Workload:
    """A model of the registry (:mod:`gpipe_repro.models`) and its inputs, described as data so a
    calibration can be cached by it and rebuilt in another process."""

    name: str                         # a label for tables ("AmoebaNet-D (18, 32), 32x32")
    family: str                       # "amoebanet-d", "transformer-lm", ...
    options: tuple[tuple[str, Any], ...]   # builder keywords, as sorted pairs (hashable)
    kind: str                         # "image" (float images, class targets) or "tokens" (LM)
    input_shape: tuple[int, ...]      # per example: (C, H, W) or (T,)
    classes: int                      # class count or vocabulary size (targets are drawn below it)
    batch: int | None = None          # the mini-batch a memory plan assumes (not part of key())

    @classmethod
    def create(cls, name: str, family: str, kind: str, input_shape: Sequence[int], classes: int,
               batch: int | None = None, **options: Any) -> Workload:
        """Keyword `options` go to the family's builder; checked here, before any work starts."""
        require_one_of("workload kind", kind, KINDS)
        if batch is not None and batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if ":" in family:           # a user's factory, "module:function"
            params = inspect.signature(_factory(family)).parameters
            if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                unknown = sorted(set(options) - set(params))
                if unknown:
                    raise ValueError(f"{family} takes no option {', '.join(unknown)}; it takes: "
                                     f"{', '.join(params) or 'none'}")
        else:
            known = get_family(family).options()
            unknown = sorted(set(options) - set(known))
            if unknown:
                raise ValueError(f"{family} has no option {', '.join(unknown)}; its options are: "
                                 f"{', '.join(known)}")
        return cls(name, family, tuple(sorted(options.items())), kind, tuple(input_shape), classes,
                   batch)

    def with_batch(self, batch: int) -> Workload:
        """The same workload with the mini-batch a memory plan assumes."""
        return replace(self, batch=batch)

    def key(self) -> str:
        """A stable identifier of everything that determines the costs (for a user's factory, its
        module's source too)."""
        parts: list[Any] = [self.family, self.options, self.kind, self.input_shape, self.classes]
        if ":" in self.family:
            parts.append(_factory_source_hash(self.family))
        text = json.dumps(parts, default=repr)
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def build(self, device: torch.device | str = "cpu", seed: int = 0) -> list[nn.Module]:
        """The model's layers (on ``meta`` nothing is allocated)."""
        torch.manual_seed(seed)
        with torch.device(device):
            if ":" in self.family:
                return list(_factory(self.family)(**dict(self.options)))
            return list(build(self.family, **dict(self.options)))

    def sample(self, batch: int, device: torch.device | str = "cpu",
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A synthetic (inputs, targets) batch of `batch` examples (on ``meta``: shapes only, nothing
        allocated)."""
        floats = self.kind in ("image", "features")
        if torch.device(device).type == "meta":
            dtype = torch.float32 if floats else torch.long
            y_shape = (batch,) if floats else (batch, *self.input_shape)
            return (torch.empty((batch, *self.input_shape), dtype=dtype, device="meta"),
                    torch.empty(y_shape, dtype=torch.long, device="meta"))
        g = torch.Generator().manual_seed(seed)
        if floats:
            x = torch.randn((batch, *self.input_shape), generator=g)
            y = torch.randint(0, self.classes, (batch,), generator=g)
        else:
            x = torch.randint(0, self.classes, (batch, *self.input_shape), generator=g)
            y = torch.randint(0, self.classes, (batch, *self.input_shape), generator=g)
        return x.to(device), y.to(device)

    def loss_fn(self) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """The training loss: AmoebaNet's (images), the language models' (tokens), cross-entropy
        (features)."""
        losses: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
            "image": amoebanet_loss, "tokens": lm_loss, "features": F.cross_entropy}
        return losses[self.kind]

    def planner_inputs(self) -> tuple[list[nn.Module], torch.Tensor, torch.Tensor,
                                      Callable[[Any, torch.Tensor], torch.Tensor]]:
        """(layers, sample, target, loss) on ``meta`` at ``batch``: what the memory planner takes."""
        if self.batch is None:
            raise ValueError(f"workload {self.name!r} has no batch: use with_batch(n) first")
        x, y = self.sample(self.batch, "meta")
        return self.build("meta"), x, y, self.loss_fn()

    def describe(self) -> str:
        """The name, with the batch's shape and dtype where the workload has one."""
        if self.batch is None:
            return self.name
        x, _ = self.sample(self.batch, "meta")
        return f"{self.name}, batch {tuple(x.shape)} {str(x.dtype).replace('torch.', '')}"


