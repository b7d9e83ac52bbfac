"""The paper's parameter counts, from models built on the meta device (nothing allocated).

AmoebaNet-D: Table 1's counts are those of the *training* model, auxiliary head included (at the
224x224 input of Table 1); without it every D count is ~0.65M lower (-0.8% at (18, 208), -2% at
(18, 128)). AmoebaNet-B (18, 512) is the 557M of Table 4, without the auxiliary head.
"""
from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from gpipe_repro.models import BYTES_PER_PARAM, FAMILIES, build, model_size
from gpipe_repro.models.amoebanet import AuxHead
from gpipe_repro.models.translation import count_non_embedding, translation_transformer

AMOEBANET_D = [((18, 208), 81.8e6), ((18, 416), 318.3e6), ((18, 544), 541.0e6),
               ((36, 544), 1.054e9), ((72, 512), 1.843e9), ((18, 256), 122.6e6), ((18, 128), 32.2e6)]
TRANSFORMER_L = [(3, 282.2e6), (13, 785.8e6), (103, 5.32e9)]
TRANSLATION = [((6, 8192, 16), 0.277e9), ((24, 8192, 16), 1.107e9), ((12, 16384, 32), 1.107e9)]


def close(value: float, expected: float, tolerance: float) -> bool:
    return abs(value - expected) <= tolerance * expected


@pytest.mark.parametrize("size,expected", AMOEBANET_D)
def test_amoebanet_d_counts_match_table_1(size: tuple[int, int], expected: float) -> None:
    L, F = size
    total = model_size("amoebanet-d", L=L, F=F, num_classes=1001, aux_head=True, image_size=224).total
    assert close(total, expected, 0.005), f"AmoebaNet-D{size}: {total:,} vs {expected:,.0f}"


def test_amoebanet_b_count_matches_table_4() -> None:
    total = model_size("amoebanet-b", L=18, F=512, num_classes=1001, aux_head=False).total
    assert close(total, 557.3e6, 0.005), f"{total:,}"


def test_aux_head_is_the_only_difference_and_only_in_training_models() -> None:
    with torch.device("meta"):
        with_aux = build("amoebanet-d", L=6, F=32, aux_head=True)
        without = build("amoebanet-d", L=6, F=32, aux_head=False)
    aux = [layer for layer in with_aux if isinstance(layer, AuxHead)]
    assert len(aux) == 1 and len(with_aux) == len(without) + 1
    n_aux = sum(p.numel() for p in aux[0].parameters())
    assert (sum(p.numel() for p in with_aux.parameters())
            == sum(p.numel() for p in without.parameters()) + n_aux)


@pytest.mark.parametrize("L,expected", TRANSFORMER_L)
def test_transformer_l_counts_match_table_1(L: int, expected: float) -> None:
    total = model_size("transformer-lm", L=L).total
    assert close(total, expected, 0.01), f"Transformer-{L}: {total:,} vs {expected:,.0f}"


def test_largest_transformer_is_counted_without_memory() -> None:
    # 937 GiB of parameters: counting them can only work without materializing them
    size = model_size("transformer-lm", L=1663)       # 83.9B parameters, 937 GiB at 12 B/param
    assert close(size.total, 83.9e9, 0.01)
    assert size.bytes == size.total * BYTES_PER_PARAM
    assert len(size.layers) == 1663 + 2


@pytest.mark.parametrize("shape,expected", TRANSLATION)
def test_translation_non_embedding_counts(shape: tuple[int, int, int], expected: float) -> None:
    with torch.device("meta"):
        model = translation_transformer(*shape)
    assert close(count_non_embedding(model), expected, 0.01)


def test_deep_and_wide_translation_models_are_the_same_size() -> None:
    with torch.device("meta"):
        deep = count_non_embedding(translation_transformer(24, 8192, 16))
        wide = count_non_embedding(translation_transformer(12, 16384, 32))
    assert close(deep, wide, 0.001)


def test_tied_weights_count_once() -> None:
    tied = model_size("transformer-t", L=2, H=64, A=2, d_model=32, vocab_size=100)
    untied = model_size("transformer-t", L=2, H=64, A=2, d_model=32, vocab_size=100,
                        tie_embeddings=False)
    assert tied.shared == 100 * 32
    assert untied.shared == 0 and untied.total == tied.total + 100 * 32
    assert sum(n for _, _, n in tied.layers) == tied.total + tied.shared


def test_gpt2_small_has_its_known_size() -> None:
    v, p, d, n = 50257, 1024, 768, 12
    expected = v * d + p * d + n * (12 * d * d + 13 * d) + 2 * d      # 124,439,808
    assert model_size("gpt2").total == expected


def test_every_family_builds_on_meta_with_its_defaults() -> None:
    for name in FAMILIES:
        size = model_size(name)
        assert size.total > 1e6 and len(size.layers) >= 3, name


def test_unknown_options_are_named() -> None:
    with pytest.raises(ValueError, match="no option depth"):
        build("transformer-lm", depth=3)
    with pytest.raises(ValueError, match="unknown model family"):
        build("resnet")


def test_models_command_prints_layers_total_and_memory() -> None:
    import typer

    from gpipe_repro.commands.models import register

    app = typer.Typer()
    app.callback()(lambda: None)     # a group, as in gpipe_repro.cli, even with one command
    register(app)
    runner = CliRunner()
    listing = runner.invoke(app, ["models"])
    assert listing.exit_code == 0, listing.output
    for name in FAMILIES:
        assert name in listing.output
    shown = runner.invoke(app, ["models", "amoebanet-d", "--L", "18", "--F", "208",
                                "--num-classes", "1001"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    total = model_size("amoebanet-d", L=18, F=208, num_classes=1001).total
    assert f"{total:,}" in shown.output
    assert f"{total * BYTES_PER_PARAM / 2**30:.2f} GiB" in shown.output
    assert "stem_cell_0" in shown.output and "head" in shown.output
    bad = runner.invoke(app, ["models", "amoebanet-d", "--depth", "3"])
    assert bad.exit_code != 0 and "no option depth" in bad.output
