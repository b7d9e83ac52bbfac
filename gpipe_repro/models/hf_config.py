"""A transformers config from a family name and sizes, or from a ``config.json``: no download.

::

    cfg = hf_config("llama", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336,
                    vocab=128256, positions=8192)          # LLaMA-3 8B's shape
    cfg = hf_config("path/to/config.json", layers=4)       # a checkpoint's config, made shallower
    with torch.device("meta"):                              # no memory: a planner traces shapes
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    layers = causal_lm_layers(model)

A family is a transformers ``model_type`` ("llama", "mistral", "qwen2", "gemma2", "gpt2", ...); its
config class's defaults fill in what is not given. The size options have one name for every family
and go to the attribute the family's config has (``hidden`` is GPT-2's ``n_embd`` and LLaMA's
``hidden_size``); any other keyword is a config attribute, given as is. An option the family's config
does not have is an error, not a silently ignored attribute. Sizes not given follow the given ones in
the base config's proportions (a new width scales the intermediate one and sets the head size, a new
head count keeps the query heads per key-value head); other values derived from the sizes (the
per-layer attention types) are derived by the config class itself, so a ``config.json`` whose depth
is changed gets its ``layer_types`` rebuilt.
"""
from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["SIZE_OPTIONS", "has_size", "hf_config"]

# option -> the config attributes it may set, first one the family's config has
SIZE_OPTIONS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers",),
    "hidden": ("hidden_size",),
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "intermediate": ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim"),   # Falcon's, OPT's
    "vocab": ("vocab_size",),
    "positions": ("max_position_embeddings",),
    "tie": ("tie_word_embeddings",),
}


def _read_json(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path} has no config.json: give a config.json file or the folder holding it")
    try:
        values = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not JSON ({e}): give a transformers config.json, or the folder "
                         "holding one") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"{file} is not a transformers config (it has no model_type)")
    return values


def hf_config(family_or_path: str | os.PathLike[str], *, layers: int | None = None,
              hidden: int | None = None, heads: int | None = None, kv_heads: int | None = None,
              head_dim: int | None = None, intermediate: int | None = None, vocab: int | None = None,
              positions: int | None = None, tie: bool | None = None, **config: Any) -> Any:
    """A ``transformers.PretrainedConfig``: the family's defaults (a ``model_type``), or a
    ``config.json`` (the file or its folder), with the given sizes and config attributes on top.

    Raises ValueError, before building anything, for an unknown family, a missing or foreign
    ``config.json``, or an option the family's config does not have (naming the ones it has).
    """
    from transformers import CONFIG_MAPPING

    path, name = Path(family_or_path), str(family_or_path)
    if isinstance(family_or_path, os.PathLike) or "/" in name or name.endswith(".json") or \
            (path.exists() and name not in CONFIG_MAPPING):
        values = _read_json(path)
        family = str(values.pop("model_type"))
    else:
        values, family = {}, str(family_or_path)
    if family not in CONFIG_MAPPING:
        close = difflib.get_close_matches(family, list(CONFIG_MAPPING.keys()), n=3)
        raise ValueError(f"unknown model family {family!r}: give a transformers model_type"
                         f"{' (' + ', '.join(close) + '?)' if close else ''} or the path of a config.json")
    config_class = CONFIG_MAPPING[family]
    defaults = config_class()
    sizes = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
             "head_dim": head_dim, "intermediate": intermediate, "vocab": vocab,
             "positions": positions, "tie": tie}
    base = config_class(**values)
    sizes.update(_in_proportion(base, sizes))
    given: dict[str, Any] = {}
    for option, value in sizes.items():
        if value is None:
            continue
        attribute = next((a for a in SIZE_OPTIONS[option] if hasattr(defaults, a)), None)
        if attribute is not None and not _settable(config_class, attribute):
            raise ValueError(f"{family} derives its {option} ({attribute}) from its other sizes and "
                             f"cannot be given one: leave --{option.replace('_', '-')} out")
        if attribute is None:
            usable = [o for o in SIZE_OPTIONS if has_size(defaults, o)]
            text = getattr(getattr(defaults, "text_config", None), "model_type", None)
            raise ValueError(f"{family} has no {option} ({' or '.join(SIZE_OPTIONS[option])}); its size "
                             f"options are: {', '.join(usable)}" + (
                                 f". Its language model's config is {text}: use hf:{text}"
                                 if text in CONFIG_MAPPING and text != family else ""))
        given[config_class.attribute_map.get(attribute, attribute)] = value   # GPT-2: n_embd
    unknown = sorted(k for k in config if not hasattr(defaults, k))
    if unknown:
        raise ValueError(f"{config_class.__name__} has no attribute {', '.join(unknown)}: check the "
                         "spelling, or use a size option (" + ", ".join(SIZE_OPTIONS) + ")")
    given.update({k: v for k, v in _attributes_in_proportion(base, sizes).items() if k not in config})
    given.update(config)
    if config_class.attribute_map.get("num_hidden_layers", "num_hidden_layers") in given and \
            "layer_types" not in config:
        values.pop("layer_types", None)   # one type per layer: the config class derives them again
    vocab_size = given.get(config_class.attribute_map.get("vocab_size", "vocab_size"))
    if isinstance(vocab_size, int):    # a smaller vocabulary: special tokens past its end are dropped
        for token in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = values.get(token, getattr(defaults, token, None))
            if token not in config and isinstance(value, int) and value >= vocab_size:
                given[token] = None
    return config_class(**{**values, **given})


def _attributes_in_proportion(base: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """Config attributes that must follow new sizes for the config to be valid: GPT-J's and CodeGen's
    ``rotary_dim`` (the rotated share of each head, at most the head size), GPT-Neo's
    ``attention_types`` (one entry per layer: its global/local pattern, repeated over the layers)."""
    out: dict[str, Any] = {}
    heads, hidden = sizes.get("heads"), sizes.get("hidden")
    base_heads = getattr(base, "num_attention_heads", None)
    base_hidden = getattr(base, "hidden_size", None)
    rotary = getattr(base, "rotary_dim", None)
    if (isinstance(rotary, int) and (heads is not None or hidden is not None) and base_heads
            and base_hidden):
        head, base_head = (hidden or base_hidden) // (heads or base_heads), base_hidden // base_heads
        out["rotary_dim"] = max(2, min(head, rotary * head // base_head) // 2 * 2)
    pattern = getattr(base, "attention_layers", None)
    if isinstance(pattern, list) and pattern and sizes.get("layers") is not None and \
            hasattr(base, "attention_types"):
        out["attention_types"] = [[[pattern[i % len(pattern)]], 1] for i in range(sizes["layers"])]
    return out


def has_size(config: Any, option: str) -> bool:
    """Whether a config (of a family's defaults) takes the size `option` (one of SIZE_OPTIONS)."""
    attribute = next((a for a in SIZE_OPTIONS[option] if hasattr(config, a)), None)
    return attribute is not None and _settable(type(config), attribute)


def _settable(config_class: type, attribute: str) -> bool:
    """Whether a config takes `attribute` (not a property it derives from others, as Falcon's
    ``head_dim`` is hidden / heads)."""
    derived = getattr(config_class, attribute, None)
    return not (isinstance(derived, property) and derived.fset is None)


def _in_proportion(base: Any, sizes: dict[str, Any]) -> dict[str, int]:
    """The sizes that follow the given ones, where not given themselves, in `base`'s proportions: a
    new width or head count gives the head size hidden / heads (where the family has one), the
    intermediate width base's multiple of the hidden one, and a new head count base's number of
    query heads per key-value head. Without this, `hidden=256, heads=4` on qwen3 kept its head size
    128, 32 key-value heads and an intermediate width of 22016."""
    def read(option: str) -> Any:    # a size the family derives itself (Falcon's head_dim) is not one
        return next((getattr(base, a) for a in SIZE_OPTIONS[option]
                     if isinstance(getattr(base, a, None), int) and _settable(type(base), a)), None)
    out: dict[str, int] = {}
    hidden, heads = sizes["hidden"] or read("hidden"), sizes["heads"] or read("heads")
    changed = sizes["hidden"] is not None or sizes["heads"] is not None
    if (changed and sizes["head_dim"] is None and read("head_dim") and hidden and heads
            and hidden % heads == 0):
        out["head_dim"] = hidden // heads
    base_hidden, base_inner = read("hidden"), read("intermediate")
    if sizes["hidden"] is not None and sizes["intermediate"] is None and base_hidden and base_inner:
        out["intermediate"] = max(1, round(sizes["hidden"] * base_inner / base_hidden))
    base_heads, base_kv = read("heads"), read("kv_heads")
    if sizes["heads"] is not None and sizes["kv_heads"] is None and base_heads and base_kv:
        per_group = base_heads // base_kv if base_heads % base_kv == 0 else 1
        out["kv_heads"] = sizes["heads"] // per_group if sizes["heads"] % per_group == 0 else sizes["heads"]
    return out
