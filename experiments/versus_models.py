"""The heterogeneous models of the comparison with torch.distributed.pipelining, scaled to this host by
width (the vocabulary scaled with it, so the head keeps its cost relative to a block), and how
PyTorch's side cuts them: equal blocks per stage, the embedding (or stem) on the first stage and the
head on the last, as torchtitan splits a model.

- ``amoebanet``: AmoebaNet-D (18, 32) on 32x32 images, 10 classes (its normal and reduction cells as
  :mod:`gpipe_repro.models.amoebanet` builds them); the blocks are its 22 cells, the stem and the
  classifier the ends;
- ``transformer``: Transformer-8 in Transformer-L's proportions (d_ff = 4 d_model, vocabulary 15.6 x
  d_model as 32k is of 2048): d_model 128, vocabulary 2000, 64 tokens; the head costs about 1.3
  blocks per token;
- ``llama``: LLaMA-3.2-1B's proportions (16 blocks, GQA 4:1, intermediate 4 x hidden, tied embeddings,
  vocabulary 62.6 x hidden as 128256 is of 2048): hidden 128, vocabulary 8016, 64 tokens; the head
  costs about 4.7 blocks per token. Ours keeps the tie (a copy per cell, gradients summed); PyTorch's
  side unties it (torchtitan does not tie weights across pipeline stages), which spares it the tie's
  gradient all-reduce.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["HeterogeneousModel", "MODELS", "model", "chunk_layers", "StageChunk"]


@dataclass(frozen=True)
class HeterogeneousModel:
    """A model of the comparison: its seeded layers, batch, loss, and which layers are its ends."""

    name: str
    description: str
    build: Callable[[bool], list[nn.Module]]     # tiny -> the layers, seeded
    sample: Callable[[int, bool], tuple[torch.Tensor, torch.Tensor]]   # rows, tiny -> (x, y)
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    batch: int
    tiny_batch: int


def _amoebanet(tiny: bool) -> list[nn.Module]:
    from gpipe_repro.models.amoebanet import amoebanet
    torch.manual_seed(0)
    return list(amoebanet(3 if tiny else 18, 8 if tiny else 32, "D", 10, image_size=32))


def _images(rows: int, tiny: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, 3, 32, 32, generator=g), torch.randint(0, 10, (rows,), generator=g)


def _amoebanet_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    from gpipe_repro.models.amoebanet import amoebanet_loss
    return amoebanet_loss(out, y)


TRANSFORMER = {"L": 8, "d_model": 128, "d_ff": 512, "num_heads": 2, "vocab_size": 2000, "tokens": 64}
LLAMA = {"layers": 16, "hidden": 128, "heads": 4, "kv_heads": 1, "intermediate": 512, "vocab": 8016,
         "tokens": 64}


def _transformer(tiny: bool) -> list[nn.Module]:
    from gpipe_repro.models.transformer_lm import transformer_lm
    torch.manual_seed(0)
    t = TRANSFORMER
    return list(transformer_lm(4 if tiny else t["L"], 32 if tiny else t["d_model"], 64 if tiny else t["d_ff"],
                               t["num_heads"], 500 if tiny else t["vocab_size"]))


def _transformer_tokens(rows: int, tiny: bool) -> tuple[torch.Tensor, torch.Tensor]:
    vocab, tokens = (500, 8) if tiny else (TRANSFORMER["vocab_size"], TRANSFORMER["tokens"])
    return _tokens(rows, vocab, tokens)


def _llama(tiny: bool) -> list[nn.Module]:
    from transformers import AutoModelForCausalLM

    from gpipe_repro.models.hf import causal_lm_layers, hf_config
    s = LLAMA
    config = hf_config("llama", layers=4 if tiny else s["layers"], hidden=32 if tiny else s["hidden"],
                       heads=s["heads"], kv_heads=s["kv_heads"],
                       intermediate=64 if tiny else s["intermediate"],
                       vocab=500 if tiny else s["vocab"], tie=True)
    torch.manual_seed(0)
    return list(causal_lm_layers(AutoModelForCausalLM.from_config(config), check=False))


def _llama_tokens(rows: int, tiny: bool) -> tuple[torch.Tensor, torch.Tensor]:
    vocab, tokens = (500, 8) if tiny else (LLAMA["vocab"], LLAMA["tokens"])
    return _tokens(rows, vocab, tokens)


def _tokens(rows: int, vocab: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, tokens + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from gpipe_repro.models.transformer_lm import lm_loss
    return lm_loss(logits, targets)


MODELS: dict[str, HeterogeneousModel] = {
    "amoebanet": HeterogeneousModel("amoebanet", "AmoebaNet-D (18, 32), 32x32 images, 10 classes",
                                    _amoebanet, _images, _amoebanet_loss, batch=16, tiny_batch=4),
    "transformer": HeterogeneousModel(
        "transformer", "Transformer-8 (d 128, ff 512, 2 heads, vocab 2000, 64 tokens)", _transformer,
        _transformer_tokens, _lm_loss, batch=32, tiny_batch=4),
    "llama": HeterogeneousModel(
        "llama", "LLaMA-3.2-1B proportions (16 blocks, hidden 128, GQA 4:1, ff 512, vocab 8016, tied, "
                 "64 tokens)", _llama, _llama_tokens, _lm_loss, batch=32, tiny_batch=4),
}


def model(name: str) -> HeterogeneousModel:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose from {sorted(MODELS)}")
    return MODELS[name]


class StageChunk(nn.Module):
    """Consecutive layers as one PyTorch pipeline stage module: the previous stage's outputs arrive as
    positional arguments, and a layer that takes a tuple (AmoebaNet's cells) gets them as one."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.Sequential(*layers)

    def forward(self, *args: Any) -> Any:
        return self.layers(args[0] if len(args) == 1 else tuple(args))


def untied(layers: list[nn.Module]) -> list[nn.Module]:
    """`layers` with every parameter that two layers share replaced, in all but the first, by a copy."""
    seen: set[int] = set()
    out = []
    for layer in layers:
        shared = [(name, p) for name, p in layer.named_parameters(remove_duplicate=False) if id(p) in seen]
        if shared:
            layer = copy.deepcopy(layer)
        seen.update(id(p) for p in layer.parameters())
        out.append(layer)
    return out


def chunk_layers(layers: list[nn.Module], chunks: int) -> list[list[nn.Module]]:
    """torchtitan's cut: the blocks (every layer but the first and the last) in `chunks` runs of equal
    length (the first chunks one longer where they do not divide), the first layer (embedding or stem)
    added to the first chunk and the last (head) to the last."""
    head, blocks, tail = layers[0], layers[1:-1], layers[-1]
    if len(blocks) < chunks:
        raise ValueError(f"{len(blocks)} blocks do not cut into {chunks} chunks")
    per, extra = divmod(len(blocks), chunks)
    out, start = [], 0
    for c in range(chunks):
        n = per + (1 if c < extra else 0)
        out.append(blocks[start:start + n])
        start += n
    out[0].insert(0, head)
    out[-1].append(tail)
    return out
