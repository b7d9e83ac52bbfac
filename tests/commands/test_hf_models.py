"""`fit` / `plan` / `throughput` with a Hugging Face causal LM as the model: a config.json or
hf:<family> with size options, built on the meta device; mistakes are one usage error before any
model is built."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpipe_repro.cli import app
from gpipe_repro.commands import _hf_models

LLAMA_8B = ["hf:llama", "--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
            "--vocab", "128256", "--intermediate", "14336"]


def _tiny_config_json(directory: Path) -> Path:
    """A user's config.json, as a model hub would ship it (a small Qwen2)."""
    path = directory / "config.json"
    path.write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False}))
    return path


def _flat(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


def test_a_config_json_plans_through_the_cli(tmp_path: Path) -> None:
    config = _tiny_config_json(tmp_path)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", str(config), "--devices", "2", "--memory", "1",
                                      "--seq-len", "32", "--batch-size", "4", "--schedules", "gpipe,1f1b",
                                      "--out", str(out)], terminal_width=200)
    assert result.exit_code == 0, (result.output, result.exception)
    text = _flat(result.output)
    assert "qwen2 (layers 3, hidden 64, heads 4, kv-heads 2, intermediate 128, vocab 300)" in text
    assert "batch (4, 32) token ids" in text and "choose K=" in text
    choice = json.loads(out.read_text())["choice"]
    assert sum(choice["balance"]) == 5                    # embeddings, 3 blocks, head
    assert len(choice["balance"]) == choice["partitions"] and choice["max_peak_bytes"] > 0


def test_an_8b_llama_plans_from_its_shape_on_meta_tensors(tmp_path: Path) -> None:
    """Nothing is allocated: 8B fp32 weights would be 32 GB, the plan takes seconds."""
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", *LLAMA_8B, "--devices", "16", "--memory", "80",
                                      "--seq-len", "2048", "--batch-size", "16", "--m", "8",
                                      "--schedules", "gpipe", "--out", str(out)], terminal_width=200)
    assert result.exit_code == 0, (result.output, result.exception)
    text = _flat(result.output)
    assert "8,030,261,248 parameters, 34 layers" in text        # Llama 3 8B's count
    found = re.search(r"choose K=(\d+), M=8, schedule=gpipe, checkpoint=(\w+), balance=\[([\d, ]+)\]",
                      text)
    assert found is not None, text
    k, balance = int(found.group(1)), [int(x) for x in found.group(3).split(",")]
    assert len(balance) == k and sum(balance) == 34
    choice = json.loads(out.read_text())["choice"]
    assert 0 < choice["max_peak_bytes"] <= 80 * 2 ** 30


def test_a_family_sizes_and_other_config_attributes_reach_the_model() -> None:
    from gpipe_repro.commands._hf_models import hf_workload
    work = hf_workload("hf:gpt-neox", 2, {"layers": 3, "hidden": 32, "heads": 2, "vocab": 100,
                                          "use_parallel_residual": False, "seq_len": 16})
    assert work.config.num_hidden_layers == 3 and work.config.use_parallel_residual is False
    layers, ids, labels, loss = work.planner_inputs()
    assert len(layers) == 5 and ids.shape == (2, 16) and labels.shape == (2, 16)
    assert all(p.device.type == "meta" for layer in layers for p in layer.parameters())


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the model is the work: these errors must come before it."""
    def refuse(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the model was built before the options were checked")
    monkeypatch.setattr(_hf_models, "causal_lm_layers_of", refuse)


@pytest.mark.parametrize("args, says", [
    (["plan", "{tmp}/missing/config.json"], "no Hugging Face config at"),
    (["fit", "hf:nonesuch"], "unknown Hugging Face family 'hf:nonesuch': use hf:<family> with a "
                             "transformers model type (llama, mistral"),
    (["plan", "llama"], "unknown model 'llama': use one of"),
    (["plan", "hf:llama", "--layers", "0"], "--layers takes a whole number >= 1, got 0"),
    (["fit", "hf:llama", "--heads", "32", "--kv-heads", "5"], "give --kv-heads a divisor of 32"),
    (["plan", "hf:gpt2", "--kv-heads", "2"], "hf:gpt2: gpt2 has no kv_heads (num_key_value_heads)"),
    (["plan", "hf:mistral", "--depth", "2"], "hf:mistral: MistralConfig has no attribute depth"),
    (["fit", "hf:llama", "--seq-len", "4096"], "--seq-len 4096 is longer than the model's 2048 positions"),
    (["plan", "{tmp}/config.json"], "is not a transformers config (it has no model_type)"),
])
def test_bad_models_are_one_usage_error_before_any_work(no_model: None, tmp_path: Path,
                                                        args: list[str], says: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)        # no traceback
    assert says in _flat(result.output), result.output


def test_a_family_the_layers_cannot_take_is_refused_with_the_reason() -> None:
    for family, says in (("t5", "hf:t5 has no causal-LM model in transformers"),
                         ("mamba", "cannot be pipelined by causal_lm_layers")):
        result = CliRunner().invoke(app, ["fit", f"hf:{family}", "--layers", "2", "--hidden", "32"])
        assert result.exit_code == 2, (result.output, result.exception)
        assert says in _flat(result.output), result.output


def test_throughput_takes_a_hugging_face_model(tmp_path: Path) -> None:
    config = _tiny_config_json(tmp_path)
    factory, options, vocabulary = _hf_models.throughput_model(str(config), {"layers": 2})
    assert factory == "gpipe_repro.commands._hf_models:causal_lm_layers_for"
    assert options == {"spec": str(config), "layers": 2} and vocabulary == 300
    layers = _hf_models.causal_lm_layers_for(str(config), layers=2)
    assert [name for name, _ in layers.named_children()] == ["embeddings", "block_0", "block_1", "head"]
    with pytest.raises(ValueError, match="has no attribute bogus"):
        _hf_models.throughput_model("hf:llama", {"bogus": 1})


def test_throughput_of_a_hugging_face_model_needs_no_input_shape() -> None:
    """A causal LM's example is a sequence of token ids: the command says which length it took."""
    result = CliRunner().invoke(app, ["throughput", "--model", "hf:llama", "--option", "layers=2",
                                      "--option", "hidden=32", "--option", "heads=2", "--option", "vocab=64",
                                      "--option", "intermediate=64", "--k", "2", "--m", "2",
                                      "--microbatch", "2", "--method", "flops"], terminal_width=200)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "examples of 128 token ids (--input-shape N for another length)" in _flat(result.output)
    # the results say the model's name, not the internal factory that builds it
    assert "hf:llama: K=2, M=2" in _flat(result.output) and "causal_lm_layers_for" not in result.output


def test_models_counts_a_hugging_face_config_without_building_it() -> None:
    result = CliRunner().invoke(app, ["models", *LLAMA_8B], terminal_width=200)
    assert result.exit_code == 0, (result.output, result.exception)
    text = _flat(result.output)
    assert "block_0 .. block_31 DecoderBlock 218,112,000 32" in text
    assert "parameters: 8,030,261,248 (8.03B)" in text
