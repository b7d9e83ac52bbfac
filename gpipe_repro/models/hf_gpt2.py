"""The GPT-2 family from a `transformers.GPT2Config` (no weights downloaded), as a layer sequence.

Why: GPipe should pipeline an off-the-shelf model without rewriting it. `GPT2LMHeadModel` is one
module whose forward loops over its blocks; :func:`gpt2_layers` takes the same modules apart into
``embeddings`` (wte + wpe + dropout: token ids -> hidden), ``block_i`` (each `GPT2Block` wrapped to
take and return the hidden states only) and ``head`` (ln_f + lm_head: hidden -> logits), so the
sequence computes exactly what `GPT2LMHeadModel` computes with the same weights.

Each wrapped block builds the causal mask exactly as `GPT2Model.forward` does
(``create_causal_mask``), so the equivalence holds for every attention implementation (eager
materializes the mask, SDPA uses ``is_causal``).

`lm_head` is tied to `wte` when ``config.tie_word_embeddings`` (GPT-2's default): the first and last
layers then share one ``nn.Parameter``.

Only `transformers.models.gpt2` (and the masking utilities) are imported, directly rather than
through the `transformers` top-level lazy module, and only when a builder is called, so a broken
torchvision never gets in the way.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers.models.gpt2.configuration_gpt2 import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel


class GPT2Embeddings(nn.Module):
    """Token ids (N, T) -> wte(ids) + wpe(positions), dropout."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(positions))


class GPT2BlockLayer(nn.Module):
    """One `GPT2Block` with the one-argument convention: hidden (N, T, d) -> hidden."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=positions)
        out = self.block(hidden, attention_mask=mask, position_ids=positions)
        return out[0] if isinstance(out, tuple) else out   # older transformers return a tuple


class GPT2Head(nn.Module):
    """Final LayerNorm and the language-model head: hidden -> logits (N, T, vocab)."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def gpt2_layers(config_or_model: GPT2Config | GPT2LMHeadModel) -> nn.Sequential:
    """GPT-2 as ``embeddings, block_0 .. block_{n-1}, head``.

    Given a config, a fresh `GPT2LMHeadModel(config)` (random init, transformers' own) is taken
    apart; given a `GPT2LMHeadModel`, its modules are reused, so both share the weights.
    """
    from transformers.models.gpt2.configuration_gpt2 import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel

    if isinstance(config_or_model, GPT2Config):
        model = GPT2LMHeadModel(config_or_model)
    elif isinstance(config_or_model, GPT2LMHeadModel):
        model = config_or_model
    else:
        raise TypeError("gpt2_layers() takes a transformers.GPT2Config or a GPT2LMHeadModel, got "
                        f"{type(config_or_model).__name__}")
    t = model.transformer
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    layers["embeddings"] = GPT2Embeddings(t.wte, t.wpe, t.drop)
    for i, block in enumerate(t.h):
        layers[f"block_{i}"] = GPT2BlockLayer(block, model.config)
    layers["head"] = GPT2Head(t.ln_f, model.lm_head)
    return nn.Sequential(layers)


def gpt2_config(n_layer: int = 12, n_embd: int = 768, n_head: int = 12, vocab_size: int = 50257,
                n_positions: int = 1024, dropout: float = 0.1, **kwargs: Any) -> GPT2Config:
    """A `GPT2Config` with the usual names (GPT-2 small by default; dropout sets all three).

    BOS/EOS default to the last token id (50256 for GPT-2's vocabulary), so small test vocabularies
    stay consistent.
    """
    from transformers.models.gpt2.configuration_gpt2 import GPT2Config

    kwargs.setdefault("bos_token_id", vocab_size - 1)
    kwargs.setdefault("eos_token_id", vocab_size - 1)
    return GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                      n_positions=n_positions, resid_pdrop=dropout, embd_pdrop=dropout,
                      attn_pdrop=dropout, **kwargs)


def gpt2(n_layer: int = 12, n_embd: int = 768, n_head: int = 12, vocab_size: int = 50257,
         n_positions: int = 1024, dropout: float = 0.1) -> nn.Sequential:
    """GPT-2 layers from the usual size arguments (GPT-2 small by default), random init."""
    return gpt2_layers(gpt2_config(n_layer, n_embd, n_head, vocab_size, n_positions, dropout))
