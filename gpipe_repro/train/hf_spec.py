"""A Hugging Face model as a command line names it: ``hf:<family>`` with size options, or a
``config.json``, made into a config (no weights, no download) and into the pipeline's layers, or
one plain error saying what to change.

    model_config("hf:llama", layers=32, hidden=4096, heads=32, kv_heads=8, vocab=128256,
                 intermediate=14336)                 # an 8B LLaMA's shape
    model_config("path/to/config.json", layers=4)   # a model's own config, 4 of its layers
    tiny_config("qwen3")                            # the family at sizes a CPU trains in seconds
    with torch.device("meta"):
        layers = causal_lm_layers_of(config)        # no weights: shapes only

The config itself is :func:`gpipe_repro.models.hf_config.hf_config`'s (the family's defaults, one
size name for every family, any other config attribute by its name). What this module adds is what
a command line needs around it: the ``hf:`` prefix and family spellings (``gpt-neox``), sizes
checked to be whole numbers >= 1 and kv-heads to divide the heads, transformers' own refusals turned
into a :class:`ConfigError`, the tiny sizes, a one-line description, and the layers of the
``*ForCausalLM`` a config describes (:func:`gpipe_repro.models.hf.causal_lm_layers`).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2", "gpt-neox")
"""Decoder-only families a causal-LM layer sequence is made for, as the help lists them (any other
transformers ``model_type`` whose model :func:`gpipe_repro.models.hf.causal_lm_layers` takes works
too: phi, olmo, gemma2, ...)."""

PREFIX = "hf:"

TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128,
        "positions": 256}
"""A model that trains in seconds on a CPU, in every family (sizes a family lacks are left out)."""

_WHOLE = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "positions")


class ConfigError(ValueError):
    """A family, file or size option that does not make a config; the message says what to change."""


def model_type(family: str) -> str:
    """``"hf:gpt-neox"`` -> ``"gpt_neox"``: a transformers model type, or a :class:`ConfigError`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    name = family.removeprefix(PREFIX).strip()
    for candidate in (name, name.lower().replace("-", "_")):
        if candidate in CONFIG_MAPPING:
            return candidate
    raise ConfigError(f"unknown Hugging Face family {family!r}: use hf:<family> with a transformers "
                      f"model type ({', '.join(FAMILIES)}, ...), or the path of a config.json")


def is_hf_model(spec: str) -> bool:
    """Whether a model name on a command line means a Hugging Face config: ``hf:<family>``, or a
    path (a name ending in ``.json`` or holding a ``/``, or a directory holding a ``config.json``)."""
    return spec.startswith(PREFIX) or spec.endswith(".json") or "/" in spec \
        or (Path(spec) / "config.json").is_file()


def _check_sizes(options: dict[str, Any], where: str) -> None:
    for name in _WHOLE:
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{where}: --{name.replace('_', '-')} takes a whole number >= 1, got {value!r}")


def _check_shape(config: Any, where: str) -> Any:
    """Refuse the shapes a model cannot be built with, naming the option to change; token ids a
    smaller vocabulary cannot hold are dropped."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    if heads and kv and heads % kv:
        raise ConfigError(f"{where}: kv-heads {kv} does not divide heads {heads} (each key/value "
                          f"head serves a group of query heads): give --kv-heads a divisor of {heads}")
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, token, None)
        if isinstance(value, int) and value >= config.vocab_size:
            setattr(config, token, None)
    return config


def model_config(spec: str, **options: Any) -> Any:
    """The config `spec` names (``hf:<family>``, or a path), with size `options` and config
    attributes on top; a :class:`ConfigError` says what to change."""
    from gpipe_repro.models.hf_config import hf_config
    if spec.startswith(PREFIX):
        source, where = model_type(spec), f"hf:{spec.removeprefix(PREFIX)}"
    else:
        file = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
        if not file.is_file():
            raise ConfigError(f"no Hugging Face config at {spec}: give the path of a config.json (or of "
                              "the directory holding it), or hf:<family> with size options")
        source, where = str(file), str(file)
    options = {k.replace("-", "_"): v for k, v in options.items()}
    _check_sizes(options, where)
    try:
        config = hf_config(source, **options)
    except ConfigError:
        raise
    except ValueError as e:                     # hf_config's: unknown family or option, foreign file
        raise ConfigError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - transformers' validators raise their own error types
        cause = e.__cause__ or e
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise ConfigError(f"{where}: transformers refused these sizes ({reason}); change the size "
                          "options") from None
    return _check_shape(config, where)


def family_has(family: str, option: str) -> bool:
    """Whether `family`'s config takes the size `option` (Falcon derives its head size; BLOOM has
    no position count)."""
    from gpipe_repro.models.hf_config import has_size
    return has_size(_defaults(model_type(family)), option)


@functools.cache
def _defaults(mtype: str) -> Any:
    """The family's config at its defaults (read only)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return CONFIG_MAPPING[mtype]()


def tiny_config(family: str, **options: Any) -> Any:
    """The family at the :data:`TINY` sizes (those it has), with `options` on top. Unless given,
    the head size follows the hidden size and heads (hidden / heads), and kv-heads is half the
    heads (all of them for an odd count)."""
    mtype = model_type(family)
    sizes: dict[str, Any] = {k: v for k, v in TINY.items() if family_has(mtype, k)}
    sizes.update(options)
    heads, hidden = sizes.get("heads"), sizes.get("hidden")
    if "head_dim" in sizes and "head_dim" not in options and isinstance(heads, int) \
            and isinstance(hidden, int) and heads > 0:
        sizes["head_dim"] = max(1, hidden // heads)
    if "kv_heads" in sizes and "kv_heads" not in options and "heads" in options and isinstance(heads, int):
        sizes["kv_heads"] = heads // 2 if heads % 2 == 0 else heads
    return model_config(PREFIX + mtype, **sizes)


def describe(config: Any) -> str:
    """``"llama (layers 32, hidden 4096, heads 32, kv-heads 8, intermediate 14336, vocab 128256)"``."""
    from gpipe_repro.models.hf_config import SIZE_OPTIONS
    shown = {"layers": ("num_hidden_layers",), "hidden": ("hidden_size",),
             "heads": ("num_attention_heads",), "kv-heads": ("num_key_value_heads",),
             "intermediate": SIZE_OPTIONS["intermediate"], "vocab": ("vocab_size",)}
    parts = []
    for short, names in shown.items():
        value = next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)
        if value is not None:
            parts.append(f"{short} {value}")
    return f"{config.model_type.replace('_', '-')} ({', '.join(parts)})"


def causal_lm_layers_of(config: Any) -> nn.Sequential:
    """The config's ``*ForCausalLM`` (random init, fp32, on the default device: under
    ``torch.device("meta")`` without weights) as the pipeline's layers; a family with no causal-LM
    model, or one the layers refuse, is a :class:`ConfigError` with the reason."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    from gpipe_repro.models.hf import causal_lm_layers
    family = config.model_type
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"hf:{family} has no causal-LM model in transformers (AutoModelForCausalLM "
                          f"does not take a {type(config).__name__}): use a decoder-only family "
                          f"({', '.join(FAMILIES)}, ...)")
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, AssertionError, RuntimeError) as e:   # the model's own checks of its sizes
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"hf:{family}: transformers could not build the model at these sizes "
                          f"({reason}); change the size options") from None
    try:
        return causal_lm_layers(model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
