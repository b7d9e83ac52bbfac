"""The trained model on one rank: what the other stages trained, copied into the caller's layers.

With ``runtime="distributed"`` each rank trains its own cells; the caller's model on any one rank
holds trained values only in that rank's layers (the rest keep their initial values), so
``model.state_dict()`` or a Hugging Face ``save_pretrained`` there would write a half-trained model.
:func:`gather_layers` copies every stage's trained parameters and buffers into the layers the caller
gave ``GPipe``, on one rank::

    layers = causal_lm_layers(model)                 # the layers given to GPipe
    pipe = GPipe(layers, partitions=2, runtime="distributed", ...)
    ...                                              # train
    if gather_layers(pipe, layers):                  # every rank calls it; True on rank 0
        model.save_pretrained("out")                 # the whole trained model

Replica 0's stages give the values (the replicas hold the same parameters; with
``batchnorm_stats="per_replica"`` replica 0's running statistics).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpipe_repro.distributed.process_group import control_group

__all__ = ["gather_layers"]


def gather_layers(pipe: Any, layers: Sequence[nn.Module], dst: int = 0) -> bool:
    """Copy every stage's trained parameters and buffers into `layers` (the sequence given to
    ``GPipe``: an ``nn.Sequential`` or a list, the full model on every rank) on global rank `dst`.
    A collective: every rank of the job calls it. Returns True on `dst` (whose `layers` then hold
    the whole trained model), False elsewhere. A local pipeline trains the caller's layers
    themselves: nothing to copy, True."""
    if getattr(pipe, "rank", None) is None:
        return True
    layers = list(layers)
    if len(layers) != sum(pipe.balance):
        raise ValueError(f"gather_layers: {len(layers)} layers given, the pipeline was built from "
                         f"{sum(pipe.balance)}: give the layers given to GPipe")
    pipe.runtime.check_same_batch(("gather_layers", dst, len(layers)), call="gather_layers")
    mine: dict[int, dict[str, torch.Tensor]] = {}
    if pipe.replica == 0:       # this rank's cells (one, or two in the V and interleaved schedules)
        for cell_index, cell in enumerate(pipe.cells):
            start = sum(pipe.balance[:cell_index])
            for i, layer in enumerate(cell):
                mine[start + i] = {k: v.detach().cpu() for k, v in layer.state_dict().items()}
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else []
    dist.gather_object(mine, parts if dist.get_rank() == dst else None, dst=dst, group=control_group())
    if dist.get_rank() != dst:
        return False
    with torch.no_grad():
        for part in parts:
            for index, state in part.items():
                layers[index].load_state_dict(state)
    return True
