"""Forward behaviour of every model family at tiny sizes: shapes, masks, causality, randomness."""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro.engine import boundary
from gpipe_repro.models.amoebanet import amoebanet, amoebanet_loss, main_logits
from gpipe_repro.models.amoebanet_cells import AmoebaCell
from gpipe_repro.models.amoebanet_ops import DropPath
from gpipe_repro.models.transformer_lm import transformer_lm
from gpipe_repro.models.translation import (
    OutputProjection,
    decode_logits,
    encode,
    greedy_decode,
    translation_loss,
    translation_transformer,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Hundreds of tiny ops: one thread is much faster than two spinning on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_layers(layers: nn.Sequential, x: object) -> list[Any]:
    """Every boundary value (a tensor or a tuple of them), checked against the engine's boundary rules."""
    values: list[Any] = []
    for i, layer in enumerate(layers):
        x = layer(x)
        boundary.check(x, f"layer {i}")
        values.append(x)
    return values


# ------------------------------------------------------------------------------------- AmoebaNet

@pytest.mark.parametrize("genotype", ["B", "D"])
@pytest.mark.parametrize("size,channels", [(28, 1), (32, 3)])
def test_amoebanet_shapes_on_small_images(genotype: str, size: int, channels: int) -> None:
    torch.manual_seed(0)
    F, L = 8, 3
    model = amoebanet(L, F, genotype, num_classes=10, in_channels=channels, aux_head=True,
                      image_size=size, dropout=0.5, drop_path=0.3)
    x = torch.randn(3, channels, size, size)
    values = run_layers(model, x)
    logits, aux = values[-1]
    assert logits.shape == (3, 10) and aux.shape == (3, 10)
    assert torch.isfinite(logits).all() and torch.isfinite(aux).all()
    # Spatial sizes: VALID stem, then ceil(n/2) at each of the 4 reductions; filters F, 2F, 4F.
    spatial = (size - 3) // 2 + 1
    expected = {"stem_cell_0": 1, "stem_cell_1": 2, "cell_0": 2, "cell_1": 3, "cell_2": 4}
    outputs = dict(zip([name for name, _ in model.named_children()], values))
    for name, halvings in expected.items():
        s = spatial
        for _ in range(halvings):
            s = math.ceil(s / 2)
        assert outputs[name][1].shape[-2:] == (s, s), name
    # B and D normal cells both concatenate four states (used flags 0 at states 0, 3, 4, 6).
    assert outputs["cell_2"][1].shape[1] == 4 * (4 * F)
    amoebanet_loss((logits, aux), torch.randint(0, 10, (3,))).backward()
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    with torch.no_grad():
        assert model(x).shape == (3, 10)         # no aux head in evaluation


def test_amoebanet_odd_input_and_tuple_boundaries() -> None:
    torch.manual_seed(0)
    model = amoebanet(6, 8, "D", num_classes=4, image_size=33)
    values = run_layers(model, torch.randn(2, 3, 33, 33))
    assert isinstance(values[0], torch.Tensor)                      # the stem's output
    assert all(isinstance(v, tuple) and len(v) == 2 for v in values[1:-1])
    assert values[-1].shape == (2, 4)


def test_amoebanet_aux_head_needs_the_image_size_it_was_built_for() -> None:
    model = amoebanet(3, 8, "D", num_classes=4, aux_head=True, image_size=64)
    with pytest.raises(ValueError, match="image_size"):
        model(torch.randn(2, 3, 32, 32))


def test_drop_path_replays_with_the_seed_and_differs_without() -> None:
    torch.manual_seed(0)
    model = amoebanet(3, 8, "B", num_classes=5, drop_path=0.5, dropout=0.0)
    x = torch.randn(4, 3, 32, 32)

    def forward(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        with torch.no_grad():
            return model(x)

    torch.testing.assert_close(forward(7), forward(7), rtol=0, atol=0)
    assert not torch.allclose(forward(7), forward(8))
    model.eval()
    torch.testing.assert_close(forward(7), forward(8), rtol=0, atol=0)


def test_drop_path_is_ramped_by_cell_depth_and_spares_none_ops() -> None:
    L, drop = 6, 0.3
    model = amoebanet(L, 8, "D", drop_path=drop)
    cells = [m for m in model if isinstance(m, AmoebaCell)]
    assert len(cells) == L + 4
    probs = []
    for cell in cells:
        paths = [m.drop_prob for m in cell.modules() if isinstance(m, DropPath)]
        n_none = sum(op == "none" for op in cell.genotype.ops)
        assert len(paths) == 10 - n_none and len(set(paths)) == 1
        probs.append(paths[0])
    expected = [drop * (i + 1) / (L + 4) for i in range(L + 4)]
    assert probs == pytest.approx(expected)


def test_drop_path_zeroes_whole_examples_and_keeps_the_mean() -> None:
    torch.manual_seed(0)
    layer = DropPath(0.25)
    x = torch.ones(20000, 3, 2, 2)
    y = layer(x)
    per_example = y.flatten(1)
    assert set(per_example.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}
    assert (per_example == per_example[:, :1]).all()
    assert y.mean().item() == pytest.approx(1.0, abs=0.02)


def test_amoebanet_rejects_bad_sizes_with_a_fix() -> None:
    with pytest.raises(ValueError, match="divisible by 4"):
        amoebanet(6, 10)
    with pytest.raises(ValueError, match="L >= 3"):
        amoebanet(2, 8)
    with pytest.raises(ValueError, match="genotype"):
        amoebanet(6, 8, "Z")
    assert main_logits((torch.zeros(1), torch.ones(1))).item() == 0


# --------------------------------------------------------------------------------- Transformer-L

def test_transformer_lm_shapes_and_causality() -> None:
    torch.manual_seed(0)
    model = transformer_lm(2, d_model=32, d_ff=64, num_heads=4, vocab_size=50).eval()
    ids = torch.randint(0, 50, (3, 10))
    values = run_layers(model, ids)
    assert values[0].shape == (3, 10, 32) and values[-1].shape == (3, 10, 50)
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 50
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6])           # the past ignores the future
    assert not torch.allclose(a[:, 6:], b[:, 6:])
    with pytest.raises(ValueError, match="token ids"):
        model(torch.randn(3, 10))


# -------------------------------------------------------------------------------------- T(L,H,A)

def small_translation(**kwargs: Any) -> nn.Sequential:
    torch.manual_seed(0)
    options: dict[str, Any] = dict(d_model=32, head_dim=8, vocab_size=40, dropout=0.0)
    options.update(kwargs)
    return translation_transformer(2, 64, 4, **options).eval()


def test_translation_shapes_with_padding_and_unequal_lengths() -> None:
    model = small_translation()
    src = torch.randint(1, 40, (3, 9))
    src[0, 5:] = 0
    tgt = torch.randint(1, 40, (3, 5))
    values = run_layers(model, (src, tgt))
    enc, dec, mask = values[0]
    assert enc.shape == (3, 9, 32) and dec.shape == (3, 5, 32)
    assert mask.dtype == torch.bool and mask[0].tolist() == [True] * 5 + [False] * 4
    assert all(isinstance(v, tuple) and len(v) == 3 for v in values[:-1])
    assert values[-1].shape == (3, 5, 40)
    # the attention projections map d -> 64A... here head_dim x A = 8 x 4 = 32, d = 32
    assert model.encoder_0.attn.q.weight.shape == (4 * 8, 32)


def test_source_padding_is_never_attended_to() -> None:
    model = small_translation()
    src = torch.randint(1, 40, (2, 6))
    tgt = torch.randint(1, 40, (2, 4))
    padded = torch.cat([src, torch.zeros(2, 5, dtype=torch.long)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model((src, tgt)), model((padded, tgt)), rtol=1e-5, atol=1e-5)


def test_decoder_is_causal_and_reads_the_source() -> None:
    model = small_translation()
    src = torch.randint(1, 40, (2, 6))
    tgt = torch.randint(1, 40, (2, 5))
    later = tgt.clone()
    later[:, 3:] = (later[:, 3:] + 1) % 40
    other_src = (src + 1) % 40 + 1
    with torch.no_grad():
        a, b, c = model((src, tgt)), model((src, later)), model((other_src, tgt))
    torch.testing.assert_close(a[:, :3], b[:, :3])
    assert not torch.allclose(a, c)


def test_encode_and_decode_steps_match_the_full_forward() -> None:
    model = small_translation()
    src = torch.randint(1, 40, (2, 7))
    src[1, 4:] = 0
    tgt = torch.randint(1, 40, (2, 5))
    with torch.no_grad():
        full = model((src, tgt))
        enc, mask = encode(model, src)
        torch.testing.assert_close(decode_logits(model, enc, mask, tgt), full)
        torch.testing.assert_close(decode_logits(model, enc, mask, tgt[:, :2])[:, -1], full[:, 1])
    out = greedy_decode(list(model), src, bos_id=1, eos_id=2, max_len=6)
    assert out.shape[0] == 2 and out.shape[1] <= 7 and (out[:, 0] == 1).all()
    with torch.no_grad():     # greedy: each token is the argmax given the prefix
        steps = decode_logits(model, enc, mask, out[:, :-1]).argmax(-1)
    ended = torch.cumsum(out[:, 1:] == 2, dim=1) - (out[:, 1:] == 2).long() > 0
    assert ((steps == out[:, 1:]) | ended).all()


def test_tying_clipping_and_ff_init_scaling() -> None:
    tied = small_translation()
    assert tied.output.weight is tied.embed.embed.weight
    untied = small_translation(tie_embeddings=False)
    assert untied.output.weight is not untied.embed.embed.weight
    # The feed-forward init is the plain one divided by L (same seed, same draws).
    plain = small_translation(scale_ff_init=False)
    for name in ("encoder_1.ff.0.weight", "decoder_0.ff.3.weight"):
        torch.testing.assert_close(dict(tied.named_parameters())[name],
                                   dict(plain.named_parameters())[name] / 2)
    torch.testing.assert_close(tied.encoder_0.attn.q.weight, plain.encoder_0.attn.q.weight)
    clipped = small_translation(logit_clip=0.05)
    assert isinstance(clipped.output, OutputProjection)
    src, tgt = torch.randint(1, 40, (2, 6)), torch.randint(1, 40, (2, 4))
    with torch.no_grad():
        logits = clipped((src, tgt))
        assert logits.abs().max() <= 0.05 + 1e-7
        assert tied((src, tgt)).abs().max() > 0.05


def test_translation_loss_ignores_padding() -> None:
    logits = torch.randn(2, 4, 7)
    targets = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 0]])
    loss = translation_loss(logits, targets)
    keep = targets != 0
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(loss, expected)


# ----------------------------------------------------------------------------------------- GPT-2

@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_gpt2_layers_give_the_logits_of_gpt2lmheadmodel(attention: str) -> None:
    from transformers import GPT2LMHeadModel

    from gpipe_repro.models.hf_gpt2 import gpt2_config, gpt2_layers

    config = gpt2_config(n_layer=3, n_embd=32, n_head=4, vocab_size=60, n_positions=32, dropout=0.0)
    config._attn_implementation = attention
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(config).eval()
    layers = gpt2_layers(reference)
    assert [type(m).__name__ for m in layers] == ["TokenEmbedding"] + ["DecoderBlock"] * 3 + ["LMHead"]
    ids = torch.randint(0, 60, (2, 12))
    with torch.no_grad():
        expected = reference(ids).logits
        values = run_layers(layers, ids)
    torch.testing.assert_close(values[-1], expected, rtol=1e-5, atol=1e-5)
    assert layers.head.lm_head.weight is layers.embeddings.tokens.weight     # GPT-2 ties them
