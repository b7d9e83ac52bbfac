"""Running a layer under ``torch.compile`` (``GPipe(compile=...)``).

The engine compiles each layer, not each cell: it seeds every layer's dropout masks and checks its
output between layers (:mod:`gpipe_repro.engine.stage`), which a compiled cell would have to break
its graph for anyway, and per layer the zero-bubble cut and the in-place guard work as they do in
eager mode. The layer module itself is not changed (its ``state_dict`` keys stay), and the model is
free to be used eagerly elsewhere.

Dynamo keeps its compiled variants, and its recompile limit (8 by default), per code object: every
``torch.compile(module)`` wrapper runs the same code, so a model with more than a few kinds of
layers (times training / eval and grad / no-grad variants) would exhaust one shared limit and fall
back to eager without error. Each runner here gets a code object of its own, so the limit is per
layer, as it is for a user compiling one model.
"""
from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["compiled_runner"]


def compiled_runner(layer: nn.Module, options: Mapping[str, Any]) -> Callable[[Any], Any]:
    """``layer(x)`` compiled with ``torch.compile(**options)``, with a compile cache of its own."""
    def run(x: Any) -> Any:
        return layer(x)
    own = types.FunctionType(run.__code__.replace(), run.__globals__, f"run_{type(layer).__name__}",
                             run.__defaults__, run.__closure__)
    return torch.compile(own, **options)
