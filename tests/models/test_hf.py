"""Hugging Face causal LMs pipelined by `causal_lm_layers`: one GPipe step gives the model's own loss
and gradients.

Each case builds a tiny model of one family from a config (no download, dropout 0, train mode), and
compares one GPipe step (no optimizer: gradients only) on a padded batch, labels -100 where the
padding is, with ``model(input_ids=..., attention_mask=..., labels=...).loss.backward()`` on a deep
copy of the model (the reference never calls our code): the same loss and the same gradient of
every parameter. The cases cover every family at K >= 2, every schedule, tied and untied
embeddings, M = 2..4, sliding windows shorter than the sequence and each family's own scalings.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from gpipe_repro import GPipe
from gpipe_repro.engine.schedule import CHECKPOINT_MODES, SCHEDULES
from gpipe_repro.models.hf import CausalLMLoss, causal_lm_layers

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, ROWS = 96, 12, 6
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
GPT2_SIZES = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
FAMILY_OPTIONS: dict[str, dict[str, Any]] = {
    "mistral": dict(sliding_window=5),                                   # shorter than SEQ
    "gemma2": dict(sliding_window=5, final_logit_softcapping=2.0, attn_implementation="eager"),
    "gemma3_text": dict(sliding_window=5, final_logit_softcapping=2.0, num_hidden_layers=3,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "granite": dict(embedding_multiplier=4.0, logits_scaling=3.0),
    "cohere": dict(logit_scale=0.5),
    "gpt_neox": dict(rotary_pct=0.5),
    "phi": dict(partial_rotary_factor=0.5),
    "falcon": dict(alibi=False, new_decoder_architecture=True, num_kv_heads=2),   # rotary: 7B, 40B
}


def tiny_model(family: str, tie: bool | None = None, **options: Any) -> Any:
    """A tiny `family` causal LM, random init, dropout 0, train mode."""
    kwargs = {**(GPT2_SIZES if family == "gpt2" else SIZES), **FAMILY_OPTIONS.get(family, {}), **options}
    if family == "falcon":
        kwargs.pop("head_dim")          # derived from the hidden size and heads (no setter)
    if tie is not None:
        kwargs["tie_word_embeddings"] = tie
    attention = kwargs.pop("attn_implementation", None)
    config = transformers.AutoConfig.for_model(family, **kwargs)
    for key, value in vars(config).items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    if attention is not None:
        config._attn_implementation = attention
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def padded_batch(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, a padding mask (left padding, right padding, none) and labels: the ids, -100
    where the padding is and at a few other places."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (rows, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0           # left padding
    mask[2, 7:] = 0           # right padding
    mask[rows - 1, :9] = 0    # mostly padding: its micro-batch has few tokens
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 5] = -100
    return ids, mask, labels


def pipeline_gradients(model: Any, inputs: Any, labels: torch.Tensor, **gpipe: Any) -> tuple[float, dict]:
    pipe = GPipe(causal_lm_layers(model), loss_fn=CausalLMLoss(), optimizer=None, **gpipe)
    loss = pipe.train_step(inputs, labels)
    if model.config.tie_word_embeddings and gpipe["partitions"] > 1:   # the tie crosses cells
        assert [t.cells for t in pipe.ties] == [[0, len(pipe.cells) - 1]]
    # a weight tied across cells is a copy per cell (the model's modules hold them), each with the sum
    return loss, {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def reference_gradients(model: Any, ids: torch.Tensor, mask: torch.Tensor | None,
                        labels: torch.Tensor) -> tuple[float, dict]:
    reference = copy.deepcopy(model)
    loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}


def assert_same_step(family: str, tie: bool | None, partitions: int, micro_batches: int,
                     schedule: str = "gpipe", with_mask: bool = True, **gpipe: Any) -> Any:
    model = tiny_model(family, tie)
    ids, mask, labels = padded_batch()
    expected_loss, expected = reference_gradients(model, ids, mask if with_mask else None, labels)
    loss, got = pipeline_gradients(model, (ids, mask) if with_mask else ids, labels, partitions=partitions,
                                   micro_batches=micro_batches, schedule=schedule, **gpipe)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        assert grad is not None and expected[name] is not None, f"{family}: no gradient for {name}"
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{family}: gradient of {name}: {m}")  # type: ignore[misc]
    return model


# (family, tied, partitions, micro-batches, schedule, checkpoint): every family at K >= 2, every
# schedule, tied and untied, M = 2..4, every checkpoint mode. interleaved, zb-v and dualpipe-v run
# partitions = 2 x processes cells.
CASES = [
    ("llama", False, 2, 3, "gpipe", "except_last"),
    ("mistral", False, 3, 2, "1f1b", "always"),
    ("qwen2", False, 4, 4, "zb-h1", "except_last"),
    ("qwen3", False, 4, 4, "interleaved", "never"),
    ("gemma2", False, 4, 2, "zb-v", "always"),
    ("gemma3_text", False, 2, 3, "1f1b", "except_last"),
    ("gpt_neox", False, 3, 3, "gpipe", "never"),
    ("phi", False, 2, 2, "zb-h1", "always"),
    ("olmo", False, 2, 4, "1f1b", "except_last"),
    ("granite", False, 3, 2, "gpipe", "except_last"),
    ("gemma", True, 1, 3, "gpipe", "except_last"),      # tied in one cell: nothing crosses cells
    ("gpt2", True, 2, 3, "gpipe", "always"),
    ("gemma", True, 3, 2, "1f1b", "except_last"),
    ("cohere", True, 2, 4, "zb-h1", "never"),
    ("qwen2", True, 4, 2, "interleaved", "except_last"),
    ("gemma2", True, 2, 3, "zb-v", "except_last"),
    ("olmo", False, 4, 4, "dualpipe-v", "except_last"),
    ("gpt2", True, 4, 4, "dualpipe-v", "never"),
    ("falcon", True, 2, 3, "1f1b", "except_last"),
]


def _case_id(case: tuple) -> str:
    family, tie, k, m, schedule, checkpoint = case
    return f"{family}-{'tied' if tie else 'untied'}-K{k}-M{m}-{schedule}-{checkpoint}"


@pytest.mark.parametrize("family,tie,partitions,micro_batches,schedule,checkpoint", CASES,
                         ids=map(_case_id, CASES))
def test_a_pipelined_step_gives_the_models_loss_and_gradients(family: str, tie: bool, partitions: int,
                                                                micro_batches: int, schedule: str,
                                                                checkpoint: str) -> None:
    model = tiny_model(family, tie)
    assert model.config.tie_word_embeddings == tie
    assert_same_step(family, tie, partitions, micro_batches, schedule, checkpoint=checkpoint)


def test_the_cases_cover_every_schedule_and_checkpoint_mode() -> None:
    assert {case[4] for case in CASES} == set(SCHEDULES)
    assert {case[5] for case in CASES} == set(CHECKPOINT_MODES)
    assert {(case[1], case[2] > 1) for case in CASES} == {(False, True), (True, True), (True, False)}


def test_without_a_mask_the_layers_pass_the_hidden_states_alone() -> None:
    model = assert_same_step("llama", False, 2, 2, "1f1b", with_mask=False, checkpoint="always")
    ids, _, _ = padded_batch()
    layers = causal_lm_layers(model)
    assert isinstance(layers[0](ids), torch.Tensor)


def test_the_layers_are_the_models_modules() -> None:
    model = tiny_model("gemma2", tie=True)
    layers: Any = causal_lm_layers(model)
    assert list(dict(layers.named_children())) == ["embeddings", "block_0", "block_1", "head"]
    assert layers.head.lm_head.weight is layers.embeddings.tokens.weight is model.lm_head.weight
    assert {id(p) for p in layers.parameters()} == {id(p) for p in model.parameters()}
    rotaries = [layers.block_0.rotary, layers.block_1.rotary]
    assert rotaries[0] is not rotaries[1] and model.model.rotary_emb not in rotaries   # one per layer
    assert [b.layer_type for b in (layers.block_0, layers.block_1)] == ["sliding_attention",
                                                                         "full_attention"]
    assert layers.head.softcap == 2.0


def test_the_sliding_window_and_the_padding_are_in_effect() -> None:
    """The equalities above are not vacuous: the window (5 < 12 tokens) and the padding change the
    logits of the rows they concern."""
    model = tiny_model("mistral").eval()
    ids, mask, _ = padded_batch()
    layers: Any = causal_lm_layers(model)
    assert {b.layer_type for b in list(layers)[1:-1]} == {"sliding_attention"}
    with torch.no_grad():
        windowed = _run(layers, (ids, mask))
        unpadded = _run(layers, ids)
        model.config.sliding_window = None
        full = _run(causal_lm_layers(model), (ids, mask))
    assert not torch.allclose(windowed[1, 8:], full[1, 8:])            # past the window
    torch.testing.assert_close(windowed[1, :5], full[1, :5])           # within it
    assert not torch.allclose(windowed[0, 4:], unpadded[0, 4:])        # after left padding
    torch.testing.assert_close(windowed[2, :7], unpadded[2, :7])       # before right padding


def _run(layers: Any, value: Any) -> Any:
    for layer in layers:
        value = layer(value)
    return value


def test_the_family_scalings_are_read_off_the_model() -> None:
    granite: Any = causal_lm_layers(tiny_model("granite"))
    assert granite.embeddings.multiplier == 4.0 and granite.head.divisor == 3.0
    cohere: Any = causal_lm_layers(tiny_model("cohere"))
    assert cohere.head.scale == 0.5
    plain: Any = causal_lm_layers(tiny_model("llama"))
    assert (plain.embeddings.multiplier, plain.head.scale, plain.head.divisor, plain.head.softcap) == \
        (None, None, None, None)


def test_the_loss_is_the_models_token_mean() -> None:
    model = tiny_model("llama")
    ids, mask, labels = padded_batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    total, count = CausalLMLoss()(out.logits, labels)
    assert int(count) == int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(total / count, out.loss)


@pytest.mark.parametrize("family,options,why", [
    ("mixtral", dict(output_router_logits=True, num_local_experts=2, num_experts_per_tok=1), "router"),
    ("mamba", dict(), "linear_attention"),
    ("bloom", dict(n_layer=2, n_head=4), "word_embeddings_layernorm"),
    ("biogpt", dict(), "embed_positions"),
    ("mpt", dict(d_model=32, n_heads=4, n_layers=2), "position_bias"),
    ("rwkv", dict(), "no attention mask"),
    ("falcon", dict(alibi=True), "its blocks need alibi"),
    ("opt", dict(ffn_dim=64, word_embed_proj_dim=32),
     r"OPTModel\.decoder\.embed_tokens, not one of its direct"),
])
def test_a_family_that_is_not_embed_blocks_norm_head_is_refused_before_any_work(
        family: str, options: dict, why: str) -> None:
    config = transformers.AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=32,
                                               num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=64, pad_token_id=0, **options)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.forward = lambda *args, **kwargs: pytest.fail("the model was run")
    with pytest.raises(ValueError, match=f"{type(model).__name__} \\({family}\\) cannot be pipelined"
                       f".*{why}") as refused:
        causal_lm_layers(model)
    # what to do: the setting to change where there is one, else how to write the layers
    assert "set output_router_logits=False" in str(refused.value) if family == "mixtral" else (
        "GPipe takes any sequence of layers" in str(refused.value))


def test_an_encoder_decoder_model_is_refused() -> None:
    config = transformers.AutoConfig.for_model("t5", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                                               num_layers=1, num_heads=2)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    with pytest.raises(ValueError, match="encoder-decoder"):
        causal_lm_layers(model)


def test_a_module_that_is_not_a_transformers_model_is_refused() -> None:
    with pytest.raises(ValueError, match="Linear .*not a transformers model"):
        causal_lm_layers(torch.nn.Linear(2, 2))


def test_a_forward_that_does_more_than_the_layers_is_refused() -> None:
    """A family whose structure fits but whose forward computes something else (here: the logits
    doubled) is caught by comparing logits on a test batch, not trained on another function."""
    class DoubledLogits(transformers.LlamaForCausalLM):   # type: ignore[name-defined]
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    config = transformers.AutoConfig.for_model("llama", **SIZES)
    model = DoubledLogits(config).train()
    with pytest.raises(ValueError, match="DoubledLogits \\(llama\\).*computes something the layers do not"):
        causal_lm_layers(model)
    assert model.training and all(m.training for m in model.modules())   # modes restored
    causal_lm_layers(model, check=False)   # on the caller's word


def test_a_model_on_the_meta_device_is_flattened_without_running() -> None:
    config = transformers.AutoConfig.for_model("llama", **{**SIZES, "num_hidden_layers": 4})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layers = causal_lm_layers(model)
    assert len(layers) == 6
    assert sum(p.numel() for p in layers.parameters()) == sum(p.numel() for p in model.parameters())
    assert all(p.device.type == "meta" for p in layers.parameters())


def _step_equals_reference(model: Any, ids: torch.Tensor, mask: torch.Tensor | None,
                           labels: torch.Tensor, **gpipe: Any) -> None:
    expected_loss, expected = reference_gradients(model, ids, mask, labels)
    loss, got = pipeline_gradients(model, (ids, mask) if mask is not None else ids, labels, **gpipe)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")  # type: ignore[misc]


def test_silent_wrong_mask_doge_without_padding() -> None:
    """Doge adds its dynamic mask onto a causal mask it always materializes; built the usual way, a
    batch without padding got no mask at all, and the step trained on another function (logits off
    by 0.2, one step's weights by 6e-2) while the padded check passed. Unpadded, with a mask of ones
    or none, the step now equals the model's own; and the check tries those batches, so a family that
    builds its mask otherwise is refused rather than trained."""
    from gpipe_repro.models import hf

    ids, _, _ = padded_batch()
    ids = torch.randint(3, VOCAB, ids.shape, generator=torch.Generator().manual_seed(2))
    for mask in (torch.ones_like(ids), None):
        _step_equals_reference(tiny_model("doge", tie=False), ids, mask, ids.clone(), partitions=2,
                               micro_batches=3)
    original = hf._materializes_mask
    try:
        hf._materializes_mask = lambda base: False     # the mask built as for every other family
        with pytest.raises(ValueError, match="doge.*without padding"):
            causal_lm_layers(tiny_model("doge"))
    finally:
        hf._materializes_mask = original


def test_silent_lost_dropout_starcoder2_embedding_dropout() -> None:
    """StarCoder2 drops out its embeddings with a function of a float attribute, not a module: the
    layers had no such dropout and trained deterministically where the model is random. The layers
    now apply it (equal to the model's forward under one seed, in training), and the check refuses a
    model whose forward is random in training where the layers are not."""
    from gpipe_repro.models import hf

    model = tiny_model("starcoder2")      # every dropout 0, then the embeddings' only
    model.config.embedding_dropout = model.model.embedding_dropout = 0.5
    layers = causal_lm_layers(model)
    ids, mask, _ = padded_batch()
    model.train()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        expected = model(input_ids=ids, attention_mask=mask).logits
        torch.manual_seed(3)
        got: Any = (ids, mask)
        for layer in layers.train():
            got = layer(got)
    torch.testing.assert_close(got, expected)
    original = hf._scalings

    def without_embedding_dropout(model: Any, base: Any) -> Any:
        found = original(model, base)
        return {**found, "embedding_dropout": None} if isinstance(found, dict) else found
    try:
        hf._scalings = without_embedding_dropout
        with pytest.raises(ValueError, match="random and the layers are not.*embedding_dropout=0.5"):
            causal_lm_layers(model)
    finally:
        hf._scalings = original


def test_rotary_frequencies_set_in_the_forward_are_not_a_changing_state() -> None:
    """Phi-3's LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini) sets its inv_freq buffer in every forward
    from the sequence length: the check of layers whose forward changes their state refused it at
    M > 1 ("changed its buffer 'rotary.inv_freq'"). A value the forward sets alike each time is not
    a state that repeats; the step equals the model's own."""
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
            "long_factor": [4.0, 3.0, 2.0, 1.5]}
    model = tiny_model("phi3", max_position_embeddings=64, original_max_position_embeddings=8,
                       rope_parameters=rope)
    ids, mask, labels = padded_batch()
    expected_loss, expected = reference_gradients(model, ids, mask, labels)
    loss, got = pipeline_gradients(model, (ids, mask), labels, partitions=2, micro_batches=3,
                                   checkpoint="always")
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6)


def test_a_model_whose_own_forward_fails_or_gives_nan_is_named_as_such() -> None:
    """The check that the layers compute the model's function blamed the family for what the
    model's own forward did: GPT-J at a head size below its rotary width raised transformers' raw
    size mismatch, and a float64 eager model's NaN logits on a left-padded row read as "computes
    something the layers do not (largest logit difference nan)"."""
    config = transformers.AutoConfig.for_model("gptj", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                               n_positions=64)                # rotary_dim 64 > head 8
    with pytest.raises(ValueError, match=r"GPTJForCausalLM \(gptj\): the model's own forward failed on "
                                         "a test batch"):
        causal_lm_layers(transformers.AutoModelForCausalLM.from_config(config))
    model = tiny_model("llama", attn_implementation="eager").double()
    assert len(causal_lm_layers(model)) == 4          # its NaN rows are the layers' too: accepted


def test_gpt2_is_flattened_without_transformers_unrecognized_loss_type_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's config names no loss type: reading ``model.loss_function`` logged "`loss_type=None`
    was set in the config but it is unrecognized" on every gpt2 run."""
    warned: list[str] = []
    monkeypatch.setattr(transformers.modeling_utils.logger, "warning_once", warned.append)
    causal_lm_layers(tiny_model("gpt2"))
    assert not any("loss_type" in w for w in warned), warned


def test_a_model_whose_loss_is_not_the_causal_lm_loss_is_refused() -> None:
    model = tiny_model("llama")
    model.loss_function = lambda *args, **kwargs: torch.tensor(0.0)
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        causal_lm_layers(model)
    masked = tiny_model("llama")
    masked.loss_type = "ForMaskedLM"
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        causal_lm_layers(masked)


def _position_step(family: str, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
                   labels: torch.Tensor, use_cache: bool = True, hf_checkpointing: bool = False,
                   **gpipe: Any) -> None:
    """A step on ``(ids, mask, positions)`` against the model's own on the same position ids, which
    differs from the model's without them (so the check can fail); `hf_checkpointing`: with
    transformers' own gradient checkpointing enabled on the model."""
    model = tiny_model(family, tie=True, use_cache=use_cache)
    if hf_checkpointing:
        model.gradient_checkpointing_enable()
    reference, without = copy.deepcopy(model), copy.deepcopy(model)
    expected = reference(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss
    expected.backward()
    without(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert any(not torch.allclose(a.grad, b.grad, rtol=1e-3, atol=1e-5) for a, b in
               zip(reference.parameters(), without.parameters()))
    loss, got = pipeline_gradients(model, (ids, mask, positions), labels, **gpipe)
    assert loss == pytest.approx(float(expected.detach()), rel=1e-5)
    for name, p in reference.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{family}: gradient of {name}: {m}")  # type: ignore[misc]


def test_silent_position_ids_given_with_the_batch_were_dropped() -> None:
    """``train_step((input_ids, attention_mask, position_ids), labels)`` trained on arange positions:
    the layers kept the first two items of the tuple (GPT-2, left padding, positions counted from the
    first real token: 4.834 for the model's 4.846). The position ids now reach every layer (GPT-2's
    absolute positions; rotary positions), and without a padding mask they mark packed sequences,
    which the mask keeps apart as transformers' does. A tuple of more is refused by name."""
    ids, mask, labels = padded_batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    _position_step("gpt2", ids, mask, positions, labels, partitions=2, micro_batches=3)
    # packed: two sequences per row, positions starting again at 0, no padding mask; the model's
    # forward masks attention between them without a cache (use_cache off), not with one (the default)
    packed = torch.cat([torch.arange(5), torch.arange(SEQ - 5)]).expand(ROWS, SEQ).contiguous()
    packed_ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    for use_cache in (True, False):
        _position_step("llama", packed_ids, None, packed, packed_ids.clone(), use_cache, partitions=2,
                       micro_batches=2, schedule="1f1b")
    layers = causal_lm_layers(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"position_ids\), the mask possibly None; got a tuple of 4"):
        layers[0]((ids, mask, positions, positions))


def test_silent_packed_sequences_under_hf_gradient_checkpointing_attended_across_documents() -> None:
    """With ``model.gradient_checkpointing_enable()``, transformers' training forward sets use_cache
    off and so keeps packed documents apart (position ids starting again at 0); the blocks read
    ``config.use_cache`` (on) and attended across them: loss 5.546 for the model's 5.530, gradients
    off by 180% (LLaMA; Qwen3 at K=3 the same). The blocks take use_cache off as the forward does."""
    packed = torch.cat([torch.arange(5), torch.arange(SEQ - 5)]).expand(ROWS, SEQ).contiguous()
    packed_ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(4))
    for family, k in (("llama", 2), ("qwen3", 3)):
        _position_step(family, packed_ids, None, packed, packed_ids.clone(), use_cache=True,
                       hf_checkpointing=True, partitions=k, micro_batches=2)


def test_silent_fp16_scaled_a_counted_loss_by_its_tokens_and_skipped_every_step() -> None:
    """Under fp16 a (sum, count) loss's summed loss was multiplied by the loss scale, so the scale
    applied to the token mean times the tokens: against torch.amp.GradScaler on the plain model
    (skipping 1 step of 6) the pipeline skipped all 6, its scale halving each time. It now scales the
    summed loss by the scale over the count (CausalLMLoss.target_count): GradScaler's steps."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).train()
    ref = copy.deepcopy(model)
    batches = []
    for s in range(4):
        g = torch.Generator().manual_seed(100 + s)
        ids = torch.randint(1, 128, (8, 16), generator=g)
        mask = torch.ones_like(ids)
        labels = ids.masked_fill(torch.rand(8, 16, generator=g) < 0.2, -100)
        batches.append((ids, mask, labels))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu")
    ref_skipped, ref_scale = [], []
    for ids, mask, labels in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        ref_skipped.append(scaler.get_scale() < before)
        ref_scale.append(scaler.get_scale())
    pipe = GPipe(causal_lm_layers(model), partitions=2, micro_batches=4, balance=[3, 3],
                 loss_fn=CausalLMLoss(), precision="fp16",
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    skipped, scale = [], []
    for ids, mask, labels in batches:
        pipe.train_step((ids, mask), labels)
        skipped.append(pipe.last_step_skipped)
        scale.append(pipe.loss_scale)
    assert skipped == ref_skipped and scale == ref_scale
    assert not all(skipped)


def test_silent_moshi_got_a_sliding_window_its_forward_never_applies() -> None:
    """MoshiConfig has a sliding_window (3000 by default) but MoshiModel's forward builds a plain
    causal mask; the blocks masked a window, so past it the pipeline trained another function (at
    window 70 and 80 tokens: gradients 6% off), and the layers' check, on 8 tokens, could not see it.
    The blocks now slide only where the base model's forward makes a sliding mask."""
    config = transformers.MoshiConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                      intermediate_size=64, sliding_window=6, audio_vocab_size=16,
                                      num_codebooks=1)
    torch.manual_seed(0)
    model = transformers.MoshiForCausalLM(config).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    expected = reference(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
    expected.backward()
    loss, got = pipeline_gradients(model, (ids, torch.ones_like(ids)), ids.clone(), partitions=2,
                                   micro_batches=2)
    assert loss == pytest.approx(float(expected.detach()), rel=1e-5)
    for name, p in reference.named_parameters(remove_duplicate=False):
        if p.grad is not None:
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family, rope", [
    ("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    ("phi3", {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
              "long_factor": [4.0] * 4})])
def test_silent_rotary_frequencies_followed_each_micro_batch_not_the_batch(family: str,
                                                                          rope: dict[str, Any]) -> None:
    """Rotary types whose frequencies follow the batch's largest position ("dynamic", "longrope":
    Phi-3's long-context models): a step whose micro-batches end at other positions (left padding,
    position ids counted from the first real token) trained weights 8.5e-4 off the model's, and the
    pipelined logits were 2.7e-3 off, silently, after a first step that passed. Such a step is now
    refused, training and inference alike, naming the rope type; one whose micro-batches end alike
    still equals the model's."""
    options = dict(max_position_embeddings=8, rope_parameters=rope)
    if family == "phi3":
        options.update(max_position_embeddings=64, original_max_position_embeddings=8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (4, SEQ), generator=g)
    alike = torch.ones_like(ids)
    model = tiny_model(family, tie=True, **options)
    reference = copy.deepcopy(model)
    pipe = GPipe(causal_lm_layers(model), partitions=2, micro_batches=2, loss_fn=CausalLMLoss(),
                 optimizer=None)
    loss = pipe.train_step((ids, alike, alike.cumsum(1) - 1), ids)
    expected = reference(input_ids=ids, attention_mask=alike, position_ids=alike.cumsum(1) - 1,
                         labels=ids).loss
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    padded = alike.clone()
    padded[2:, :6] = 0                          # the second micro-batch's rows end at position 5
    positions = (padded.cumsum(1) - 1).clamp(min=0)
    model = tiny_model(family, tie=True, **options)
    pipe = GPipe(causal_lm_layers(model), partitions=2, micro_batches=2, loss_fn=CausalLMLoss(),
                 optimizer=None)
    with pytest.raises(ValueError, match=f"rope_type '{rope['rope_type']}'"):
        pipe.train_step((ids, padded, positions), ids.masked_fill(padded == 0, -100))
    pipe.eval()
    with pytest.raises(ValueError, match="other frequencies than the step's first"):
        pipe((ids, padded, positions))
