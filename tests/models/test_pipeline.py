"""Every model family trains under GPipe exactly as in a plain loop, per parameter.

For each family at a tiny size, with dropout / drop-path on, uneven micro-batches, K = 2..4 and every
checkpoint mode, one GPipe step is compared with `tests.equivalence.reference_step` (the layers run
micro-batch by micro-batch, each seeded with `gpipe_repro.engine.rng.seed_layer` as the engine does, loss
weighted by n_m / N): same loss, same gradient of every parameter, same weights after the update.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.models.amoebanet import amoebanet, amoebanet_loss
from gpipe_repro.models.hf_gpt2 import gpt2_config, gpt2_layers
from gpipe_repro.models.transformer_lm import lm_loss, transformer_lm
from gpipe_repro.models.translation import translation_loss, translation_transformer
from tests.equivalence import assert_same_training

# (K, M, checkpoint): K = 2..4, every checkpoint mode, M not dividing N.
CASES = [(2, 3, "always"), (3, 2, "except_last"), (4, 3, "never")]
Case = tuple[list[nn.Module], Any, Any, Callable]   # layers, inputs, targets, loss_fn
N = 7   # 3 micro-batches of 3, 2, 2; 2 of 4, 3 (BatchNorm on 1x1 maps needs 2+ examples)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """These models run hundreds of tiny ops; two threads spinning on two busy cores make them ~20x
    slower, one thread is fastest."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def amoeba_case() -> Case:
    torch.manual_seed(0)
    model = amoebanet(3, 8, "D", num_classes=5, in_channels=1, dropout=0.2, drop_path=0.3,
                      aux_head=True, image_size=28)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 1, 28, 28, generator=g)
    y = torch.randint(0, 5, (N,), generator=g)
    return list(model), x, y, amoebanet_loss


def amoeba_b_case() -> Case:
    torch.manual_seed(0)
    model = amoebanet(3, 8, "B", num_classes=5, dropout=0.2, drop_path=0.3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 3, 32, 32, generator=g)
    y = torch.randint(0, 5, (N,), generator=g)
    return list(model), x, y, amoebanet_loss


def lm_case() -> Case:
    torch.manual_seed(0)
    model = transformer_lm(3, d_model=16, d_ff=32, num_heads=2, vocab_size=23, dropout=0.1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 23, (N, 9), generator=g)
    return list(model), ids[:, :-1], ids[:, 1:], lm_loss


def translation_case() -> Case:
    torch.manual_seed(0)
    # untied here; the tied model: test_tied_translation_model_trains_like_the_plain_tied_model
    model = translation_transformer(2, 32, 2, d_model=16, head_dim=8, vocab_size=19, dropout=0.1,
                                    tie_embeddings=False, logit_clip=4.0)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(1, 19, (N, 7), generator=g)
    src[::2, 4:] = 0                                   # padded sources
    tgt = torch.randint(1, 19, (N, 6), generator=g)    # another length
    tgt[1::3, 4:] = 0
    return list(model), (src, tgt[:, :-1]), tgt[:, 1:], translation_loss


def gpt2_case() -> Case:
    torch.manual_seed(0)
    config = gpt2_config(n_layer=3, n_embd=16, n_head=2, vocab_size=23, n_positions=16, dropout=0.1,
                         tie_word_embeddings=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 23, (N, 9), generator=g)
    return list(gpt2_layers(config)), ids[:, :-1], ids[:, 1:], lm_loss


# The translation loss is a token mean over non-padding targets, not a per-row mean: the engine
# refuses it undeclared (engine/losses.py); declared, micro-batches are weighed by rows, as the
# reference (tests/equivalence.py) weighs them.
REDUCTION = {"transformer-t": "mean"}

FAMILIES = {"amoebanet-d": amoeba_case, "amoebanet-b": amoeba_b_case, "transformer-lm": lm_case,
            "transformer-t": translation_case, "gpt2": gpt2_case}


@pytest.mark.parametrize("k,m,checkpoint", CASES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_under_gpipe_as_in_a_plain_loop(family: str, k: int, m: int,
                                                      checkpoint: str) -> None:
    layers, x, y, loss_fn = FAMILIES[family]()
    assert_same_training(layers, x, y, loss_fn, partitions=k, micro_batches=m, checkpoint=checkpoint,
                         rtol=1e-5, atol=1e-5, loss_reduction=REDUCTION.get(family))


def test_amoebanet_cut_after_the_stem_and_after_the_aux_head() -> None:
    """Cuts where the boundary is a bare tensor (stem -> first cell) and a 3-tuple carrying the aux
    logits (aux head -> next cell)."""
    layers, x, y, loss_fn = amoeba_case()
    names = [type(layer).__name__ for layer in layers]
    assert names[0] == "Stem" and names[6] == "AuxHead" and len(names) == 10
    assert_same_training(layers, x, y, loss_fn, partitions=4, micro_batches=3,
                         checkpoint="except_last", balance=[1, 5, 1, 3], rtol=1e-5, atol=1e-5)


def test_randomness_is_really_on() -> None:
    """The equality above is not vacuous: two steps of the same model draw different masks."""
    layers, x, y, loss_fn = translation_case()
    pipe = GPipe(layers, partitions=2, micro_batches=3, loss_fn=loss_fn, loss_reduction="mean",
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    assert pipe.train_step(x, y) != pipe.train_step(x, y)


def test_tied_translation_model_trains_like_the_plain_tied_model() -> None:
    """The shared source/target embedding and the output projection: one parameter in the first and
    the last cell (a copy each, gradients summed)."""
    layers, x, y, loss_fn = translation_case()
    torch.manual_seed(0)
    tied = list(translation_transformer(2, 32, 2, d_model=16, head_dim=8, vocab_size=19, dropout=0.1,
                                        logit_clip=4.0))
    pipe = assert_same_training(tied, x, y, loss_fn, partitions=3, micro_batches=3,
                                checkpoint="except_last", rtol=1e-5, atol=1e-5, loss_reduction="mean")
    assert [t.cells for t in pipe.ties] == [[0, 2]]
