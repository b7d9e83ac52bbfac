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

__all__ = ["HFWorkload", "causal_lm_layers_for", "hf_workload", "is_hf_model", "throughput_args"]


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


def _option_value(key: str, value: str) -> str:
    """A factory keyword as ``--option key=value`` spells it (a Python literal)."""
    return f"{key}={value!r}" if key == "spec" else f"{key}={value}"


def throughput_args(args: list[str]) -> list[str]:
    """`gpipe-repro throughput` arguments with ``--model hf:<family>`` or ``--model <config.json>``
    turned into the factory that builds it (``--option`` values are its size options), fed token
    ids (``--kind tokens``) of the model's vocabulary (``--classes``) unless those are given. Other
    arguments are returned unchanged; a bad config is a :class:`ConfigError`."""
    out, spec, i = [], None, 0
    while i < len(args):
        arg = args[i]
        if arg == "--model" and i + 1 < len(args) and is_hf_model(args[i + 1]):
            spec, i = args[i + 1], i + 2
            continue
        if arg.startswith("--model=") and is_hf_model(arg.partition("=")[2]):
            spec, i = arg.partition("=")[2], i + 1
            continue
        out.append(arg)
        i += 1
    if spec is None:
        return args
    import ast
    sizes: dict[str, Any] = {}
    for j, arg in enumerate(out):
        item = out[j + 1] if arg == "--option" and j + 1 < len(out) else \
            arg.partition("=")[2] if arg.startswith("--option=") else None
        if item is not None and "=" in item:
            key, _, value = item.partition("=")
            try:
                sizes[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                sizes[key] = value
    config = model_config(spec, **sizes)              # checked now, before the calibration's work
    extra = ["--model", FACTORY, "--option", _option_value("spec", spec)]
    if not any(a == "--kind" or a.startswith("--kind=") for a in out):
        extra += ["--kind", "tokens"]
    if not any(a == "--classes" or a.startswith("--classes=") for a in out):
        extra += ["--classes", str(config.vocab_size)]
    return extra + out
