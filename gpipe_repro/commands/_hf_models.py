"""Hugging Face causal LMs as the model of `fit`, `plan` and `throughput`, named on the command line.

    gpipe-repro plan hf:llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --vocab 128256 \\
        --intermediate 14336 --devices 16 --memory 80          # an 8B LLaMA, from its shape alone
    gpipe-repro fit path/to/config.json --k 4 --m 8 --memory 40 --seq-len 4096
    gpipe-repro throughput --model hf:qwen3 --option layers=4 --option hidden=128 --input-shape 64 \\
        --k 2 --m 4

A model is ``hf:<family>`` with size options (:mod:`gpipe_repro.train.hf_spec`) or the path of a
``config.json``. For the planner it is built on the meta device (no weights, nothing downloaded: an
8B model costs a second or two) and taken apart into the pipeline's layers by
:func:`gpipe_repro.models.hf.causal_lm_layers`; the batch is ``--batch-size`` packed sequences of
``--seq-len`` token ids (no padding mask), trained with fp32 weights and the causal-LM loss. For
`throughput`, whose calibration times the real layers, the same model is built with weights through
the factory :func:`causal_lm_layers_for`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe_repro.train.hf_spec import ConfigError, causal_lm_layers_of, describe, is_hf_model, model_config

DEFAULT_SEQ_LEN = 2048
DEFAULT_BATCH = 32
FACTORY = f"{__name__}:causal_lm_layers_for"

__all__ = ["HFWorkload", "causal_lm_layers_for", "hf_workload", "is_hf_model", "throughput_model"]


@dataclass(frozen=True)
class HFWorkload:
    """A Hugging Face config with the training batch the planner assumes (shapes only)."""

    spec: str               # as given: hf:<family> or a path
    config: Any             # a transformers PretrainedConfig
    batch: int
    seq_len: int

    def planner_inputs(self) -> tuple[list[nn.Module], torch.Tensor, torch.Tensor,
                                      Callable[[Any, torch.Tensor], Any]]:
        """(layers on ``meta``, token ids, labels, the loss): what the memory planner takes."""
        from gpipe_repro.models.hf import CausalLMLoss
        ids = torch.empty((self.batch, self.seq_len), dtype=torch.long, device="meta")
        with torch.device("meta"):
            layers = list(causal_lm_layers_of(self.config))
        return layers, ids, ids.clone(), CausalLMLoss()

    def describe(self) -> str:
        model = f"hf:{describe(self.config)}" if self.spec.startswith("hf:") else \
            f"{describe(self.config)} from {self.spec}"
        return f"{model}, batch ({self.batch}, {self.seq_len}) token ids, fp32 weights"


def hf_workload(spec: str, batch: int | None, options: dict[str, Any]) -> HFWorkload:
    """`spec` with its size `options` and ``seq_len``; a :class:`ConfigError` (a ValueError) says
    what to change, before any model is built."""
    options = dict(options)
    seq_len = options.pop("seq_len", None)
    config = model_config(spec, **options)
    positions = getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, positions)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"--seq-len takes a whole number >= 1 (tokens per sequence), got {seq_len!r}")
    if seq_len > positions:
        raise ConfigError(f"--seq-len {seq_len} is longer than the model's {positions} positions "
                          "(max_position_embeddings): lower --seq-len, or raise --positions")
    return HFWorkload(spec, config, batch or DEFAULT_BATCH, seq_len)


def causal_lm_layers_for(spec: str, **options: Any) -> nn.Sequential:
    """The model `spec` names (``hf:<family>`` or a config path) with weights, as the pipeline's
    layers: the factory `gpipe-repro throughput` calibrates."""
    return causal_lm_layers_of(model_config(spec, **options))


def throughput_model(spec: str, sizes: dict[str, Any]) -> tuple[str, dict[str, Any], int]:
    """`gpipe-repro throughput --model hf:<family>` (or a config.json) with its size `sizes` (the
    ``--option`` values): the factory that builds it, the factory's keyword arguments, and the
    model's vocabulary size (the token ids it is fed). A bad config is a :class:`ConfigError`, raised
    before the calibration's work."""
    config = model_config(spec, **sizes)
    return FACTORY, {"spec": spec, **sizes}, config.vocab_size
