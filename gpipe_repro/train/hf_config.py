"""A Hugging Face model config, from a family name and size options or from a `config.json`.

    family_config("llama", layers=32, hidden=4096, heads=32, kv_heads=8, vocab=128256,
                  intermediate=14336)                # an 8B LLaMA's shape, no weights, no download
    file_config("path/to/config.json", layers=4)    # a model's own config, 4 of its layers
    hf_config("hf:qwen3", **sizes), hf_config("path/to/config.json")   # either, by how it is named

Size options have short names that mean the same in every family (:data:`SIZE_OPTIONS`: ``layers``
is GPT-2's ``n_layer`` and LLaMA's ``num_hidden_layers``); any other attribute of the family's config
class is accepted under its own name (``rope_theta``, ``tie_word_embeddings``). Everything is
checked here, before a model is built, and every mistake is a :class:`ConfigError` saying what to
change. Only configs are made: building a model from one (on ``meta`` for planning) is the caller's.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2", "gpt-neox")
"""The decoder-only families a causal-LM layer sequence is made for (their transformers model
types, with ``gpt-neox`` for ``gpt_neox``)."""

SIZE_OPTIONS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers",),
    "hidden": ("hidden_size",),
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads",),
    "intermediate": ("intermediate_size", "n_inner"),
    "head_dim": ("head_dim",),
    "vocab": ("vocab_size",),
    "positions": ("max_position_embeddings",),
}
"""Short size names -> the config attributes they set (the first the family's config has)."""

TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "head_dim": 16,
        "positions": 256}
"""A model that trains in seconds on a CPU, in every family (options a family lacks are skipped)."""

PREFIX = "hf:"


class ConfigError(ValueError):
    """A family, file or size option that does not make a config; the message says what to change."""


def model_type(family: str) -> str:
    """``"gpt-neox"`` -> ``"gpt_neox"``; an unknown family is a :class:`ConfigError`."""
    name = family.removeprefix(PREFIX).strip().lower().replace("_", "-")
    if name not in FAMILIES:
        raise ConfigError(f"unknown Hugging Face family {family!r}: use hf:<family> with one of "
                          f"{', '.join(FAMILIES)}, or the path of a config.json")
    return name.replace("-", "_")


def is_hf_model(spec: str) -> bool:
    """Whether a model name on a command line means a Hugging Face config: ``hf:<family>``, or a
    path (a name ending in ``.json`` or holding a ``/``, or a directory holding a ``config.json``)."""
    return spec.startswith(PREFIX) or spec.endswith(".json") or "/" in spec \
        or (Path(spec) / "config.json").is_file()


def _config_class(mtype: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return CONFIG_MAPPING[mtype]


def _attributes(defaults: Any, options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`options` (short names or attribute names, dashes or underscores) as config attributes."""
    out: dict[str, Any] = {}
    for given, value in options.items():
        name = given.replace("-", "_")
        if name in SIZE_OPTIONS:
            target = next((a for a in SIZE_OPTIONS[name] if hasattr(defaults, a)), None)
            if target is None:
                raise ConfigError(f"{where} has no {given.replace('_', '-')} size (its config has no "
                                  f"{' or '.join(SIZE_OPTIONS[name])}): leave that option out")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: --{given.replace('_', '-')} takes a whole number >= 1, "
                                  f"got {value!r}")
            out[target] = value
        elif hasattr(defaults, name) and not callable(getattr(defaults, name)):
            out[name] = value
        else:
            raise ConfigError(f"{where} has no option --{given.replace('_', '-')}: use the sizes "
                              f"{', '.join('--' + s.replace('_', '-') for s in SIZE_OPTIONS)}, or an "
                              f"attribute of {type(defaults).__name__} by its name")
    return out


def _check_shape(config: Any, where: str) -> Any:
    """Refuse the shapes a model cannot be built with, naming the option to change."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    if heads and kv and heads % kv:
        raise ConfigError(f"{where}: kv-heads {kv} does not divide heads {heads} (each key/value "
                          f"head serves a group of query heads): give --kv-heads a divisor of {heads}")
    hidden = getattr(config, "hidden_size", None)
    if heads and hidden and getattr(config, "head_dim", None) is None and hidden % heads:
        raise ConfigError(f"{where}: hidden {hidden} is not a multiple of heads {heads}: change "
                          "--hidden or --heads")
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):   # a small vocabulary's ids
        value = getattr(config, token, None)
        if isinstance(value, int) and value >= config.vocab_size:
            setattr(config, token, None)
    return config


def _made(make: Any, where: str, **attributes: Any) -> Any:
    """``make(**attributes)``, transformers' own refusal of a shape as a :class:`ConfigError`."""
    try:
        return make(**attributes)
    except Exception as e:  # noqa: BLE001 - transformers' validators raise their own error types
        cause = e.__cause__ or e
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise ConfigError(f"{where}: transformers refused these sizes ({reason}); change the size "
                          "options") from None


def family_config(family: str, **options: Any) -> Any:
    """The family's default config (transformers' own defaults) with `options` (see the module
    docstring). What the options leave out keeps the family's default: a head size the family
    derives (LLaMA: hidden / heads) follows the sizes given, a fixed one (Qwen3, Gemma) stays; a
    default kv-heads that does not divide the heads given must be given too."""
    mtype = model_type(family)
    where = f"hf:{family.removeprefix(PREFIX)}"
    defaults = _config_class(mtype)()
    attributes = _attributes(defaults, options, where)
    return _check_shape(_made(type(defaults), where, **attributes), where)


def tiny_config(family: str, **options: Any) -> Any:
    """The family at the :data:`TINY` sizes a CPU trains in seconds (sizes the family has no
    attribute for are left out), with `options` on top. Unless given, the head size follows the
    hidden size and heads given (hidden / heads), and kv-heads is half the heads (all of them for
    an odd count)."""
    defaults = _config_class(model_type(family))()
    sizes = {k: v for k, v in TINY.items() if any(hasattr(defaults, a) for a in SIZE_OPTIONS[k])}
    sizes.update(options)
    heads, hidden = sizes.get("heads"), sizes.get("hidden")
    if "head_dim" in sizes and "head_dim" not in options and isinstance(heads, int) \
            and isinstance(hidden, int) and heads > 0:
        sizes["head_dim"] = max(1, hidden // heads)
    if "kv_heads" in sizes and "kv_heads" not in options and "heads" in options and isinstance(heads, int):
        sizes["kv_heads"] = heads // 2 if heads % 2 == 0 else heads
    return family_config(family, **sizes)


def file_config(path: str | Path, **options: Any) -> Any:
    """The config in `path` (a ``config.json``, or a directory holding one), with `options`."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ConfigError(f"no Hugging Face config at {path}: give the path of a config.json (or of "
                          "the directory holding it), or hf:<family> with size options")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file} is not a readable JSON config ({e}): give a model's config.json") \
            from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(f"{file} has no \"model_type\" (a Hugging Face config.json names its family, "
                          f"e.g. \"llama\"): add it, or use hf:<family> with size options")
    mtype = model_type(data["model_type"])
    cls = _config_class(mtype)
    attributes = _attributes(_made(cls.from_dict, str(file), config_dict=dict(data)), options, str(file))
    if {"hidden_size", "num_attention_heads"} & set(attributes) and "head_dim" not in attributes \
            and data.get("head_dim") == data.get("hidden_size", 0) // max(1, data.get(
                "num_attention_heads", 1)):
        data.pop("head_dim")          # derived from the sizes being changed: derive it again
    return _check_shape(_made(cls.from_dict, str(file), config_dict={**data, **attributes}), str(file))


def hf_config(spec: str, **options: Any) -> Any:
    """``hf:<family>`` -> :func:`family_config`; anything else is a path -> :func:`file_config`."""
    if spec.startswith(PREFIX):
        return family_config(spec, **options)
    return file_config(spec, **options)


def describe(config: Any) -> str:
    """``"llama (layers 32, hidden 4096, heads 32, kv-heads 8, intermediate 14336, vocab 128256)"``."""
    parts = []
    for short, names in SIZE_OPTIONS.items():
        if short in ("positions", "head_dim"):
            continue
        value = next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)
        if value is not None:
            parts.append(f"{short.replace('_', '-')} {value}")
    family = config.model_type.replace("_", "-")
    return f"{family} ({', '.join(parts)})"
