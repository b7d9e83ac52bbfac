"""The GPT-2 family from a `transformers.GPT2Config` (no weights downloaded), as a layer sequence.

Why: GPipe should pipeline an off-the-shelf model without rewriting it. :func:`gpt2_layers` is the
generic flattener :func:`gpipe_repro.models.hf.causal_lm_layers` applied to a `GPT2LMHeadModel`:
``embeddings`` (wte + wpe + dropout: token ids -> hidden), ``block_i`` (each `GPT2Block`, its causal
mask built as `GPT2Model.forward` builds it) and ``head`` (ln_f + lm_head: hidden -> logits), the
same modules, so the sequence computes exactly what `GPT2LMHeadModel` computes with the same
weights. Given token ids alone, the layers exchange the hidden states alone; given
``(input_ids, attention_mask)``, they pass the padding mask along.

`lm_head` is tied to `wte` when ``config.tie_word_embeddings`` (GPT-2's default): the first and last
layers then share one ``nn.Parameter``.

`transformers` is imported only when a builder is called.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from gpipe_repro.models.hf import causal_lm_layers

if TYPE_CHECKING:
    from transformers.models.gpt2.configuration_gpt2 import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel


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
    return causal_lm_layers(model, check=False)


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
