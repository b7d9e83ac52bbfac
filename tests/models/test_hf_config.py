"""`hf_config`: a transformers config from a family and sizes, or a config.json, and a model built
from it on the meta device flattened by `causal_lm_layers` without weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpipe_repro.memory.planner import MemoryPlanner
from gpipe_repro.models.hf import CausalLMLoss, causal_lm_layers, hf_config

transformers = pytest.importorskip("transformers")


def test_llama_3_8b_is_planned_on_the_meta_device() -> None:
    config = hf_config("llama", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336,
                       vocab=128256, positions=8192, tie=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layers = causal_lm_layers(model)
    assert len(layers) == 34
    assert sum(p.numel() for p in layers.parameters()) == 8_030_261_248   # Llama-3-8B's count
    assert all(p.device.type == "meta" for p in layers.parameters())
    ids = torch.empty(4, 64, dtype=torch.long, device="meta")
    plan = MemoryPlanner(layers, (ids, ids), ids, CausalLMLoss()).plan(partitions=4, micro_batches=2)
    weights = 8_030_261_248 * 12 / 4     # fp32 weight, gradient, one optimizer slot: 24 GB a device
    assert len(plan.stages) == 4 and all(0.8 * weights < s.peak < 1.5 * weights for s in plan.stages)


def test_the_size_options_go_to_the_familys_own_attributes() -> None:
    gpt2 = hf_config("gpt2", layers=2, hidden=32, heads=4, intermediate=64, vocab=96, tie=False)
    assert (gpt2.n_layer, gpt2.n_embd, gpt2.n_head, gpt2.n_inner, gpt2.vocab_size) == (2, 32, 4, 64, 96)
    assert gpt2.tie_word_embeddings is False
    gemma2 = hf_config("gemma2", layers=3, hidden=64, sliding_window=16)
    assert gemma2.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert gemma2.sliding_window == 16


def test_a_config_json_is_read_and_resized(tmp_path: Path) -> None:
    original = hf_config("gemma2", layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=96)
    original.to_json_file(tmp_path / "config.json")
    for given in (tmp_path / "config.json", str(tmp_path / "config.json"), tmp_path):
        assert hf_config(given).to_dict() == original.to_dict()
    shallower = hf_config(tmp_path, layers=2)
    assert shallower.num_hidden_layers == 2 and len(shallower.layer_types) == 2
    assert (shallower.hidden_size, shallower.head_dim) == (64, 16)


@pytest.mark.parametrize("args,kwargs,message", [
    (("lama",), {}, "unknown model family 'lama'.*llama"),
    (("gpt2",), {"kv_heads": 2}, "gpt2 has no kv_heads.*its size options are: layers, hidden"),
    (("llama",), {"hidden_sise": 2}, "LlamaConfig has no attribute hidden_sise"),
])
def test_a_wrong_family_or_option_says_what_to_change(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hf_config(*args, **kwargs)


def test_a_path_without_a_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ValueError, match="no model_type"):
        hf_config(tmp_path)


def test_silent_sizes_not_given_kept_the_familys_full_size_ones() -> None:
    """`fit hf:qwen3 --hidden 256 --heads 4` planned a model with Qwen3's head size 128, 32 key-value
    heads (refused: 32 does not divide 4) and an intermediate width of 22016: 147M parameters for a
    "hidden 256" model, unlike the one `run causal-lm` builds. Sizes not given now follow the given
    ones in the family's proportions."""
    qwen3 = hf_config("qwen3", layers=4, hidden=256, heads=4)
    assert (qwen3.head_dim, qwen3.num_key_value_heads) == (64, 4)
    assert qwen3.intermediate_size == round(256 * 22016 / 4096)     # LLaMA-style: 5.375 x hidden
    llama3 = hf_config("llama", hidden=4096, heads=32, kv_heads=8, intermediate=14336)
    assert (llama3.num_key_value_heads, llama3.intermediate_size) == (8, 14336)   # given: kept
    mistral = hf_config("mistral", hidden=512, heads=16)              # 4 query heads per kv head
    assert (mistral.num_key_value_heads, mistral.head_dim) == (4, 32)


def test_falcon_sizes_were_refused_for_a_head_dim_it_derives() -> None:
    """`hf:falcon --hidden 64 --heads 4` failed with transformers' "property 'head_dim' of
    'FalconConfig' object has no setter": the head size kept in proportion was given to a config that
    derives it. It is left to the config; given explicitly, it is refused naming the option."""
    falcon = hf_config("falcon", layers=2, hidden=64, heads=4)
    assert (falcon.hidden_size, falcon.num_attention_heads, falcon.head_dim) == (64, 4, 16)
    with pytest.raises(ValueError, match="derives its head_dim .* leave --head-dim out"):
        hf_config("falcon", layers=2, hidden=64, heads=4, head_dim=16)


def test_a_composite_config_names_its_language_models_family() -> None:
    """hf:gemma3 (an image-and-text config) has no size of its own: the error names hf:gemma3_text."""
    with pytest.raises(ValueError, match="gemma3 has no layers .*use hf:gemma3_text"):
        hf_config("gemma3", layers=2)


def test_attributes_that_must_follow_new_sizes_follow_them() -> None:
    """GPT-J's rotary_dim (64 of a 256-wide head) would be wider than a 16-wide head, GPT-Neo's 24
    attention types too many for 2 layers: both follow the sizes given, in the family's proportions;
    Falcon's and OPT's feed-forward widths are --intermediate."""
    assert hf_config("gptj", layers=2, hidden=64, heads=4).rotary_dim == 4       # a quarter of the head
    neo = hf_config("gpt_neo", layers=3, hidden=64, heads=4)
    assert neo.attention_layers == ["global", "local", "global"]
    assert hf_config("falcon", layers=2, hidden=64, heads=4, intermediate=96).ffn_hidden_size == 96
    assert hf_config("opt", layers=2, hidden=64, heads=4, intermediate=96).ffn_dim == 96
