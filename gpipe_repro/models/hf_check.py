"""The check that a Hugging Face causal LM's flattened layers compute what its own forward does.

:func:`gpipe_repro.models.hf.causal_lm_layers` reads the layers off the model object; a family whose
forward does more than what is read (CTRL's scaled sinusoids, a mask built otherwise when nothing is
padded, a dropout applied as a function of an attribute) would train on another function. This runs
the model and the layers side by side on a short batch and refuses the model, by name, where they
differ.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.traced import has_values

__all__ = ["check_same_function"]


def check_same_function(model: Any, layers: nn.Sequential) -> None:
    """Raise ValueError unless `layers` give `model`'s logits on a short
    batch given three ways: padded with its mask, unpadded with a mask of ones, and token ids alone
    (a family may build its mask differently when nothing is padded: Doge's dynamic mask); and,
    where the config asks for dropout, unless the layers are random in training exactly where the
    model is (a dropout the forward applies as a function, outside any module, would otherwise be
    lost). Skipped for weights without values (meta or fake tensors)."""
    weight = next(model.parameters(), None)
    if weight is None or not has_values(weight):
        return
    window = getattr(model.config, "sliding_window", None)
    length = 8 if not isinstance(window, int) or window > 62 else max(8, window + 2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=g).to(weight.device)
    padded = torch.ones_like(ids)
    padded[1, :2] = 0
    modes = {m: m.training for m in (*model.modules(), *layers.modules())}
    try:
        model.eval()
        layers.eval()
        for mask in (padded, torch.ones_like(ids), None):
            expected, got = _both_logits(model, layers, ids, mask)
            kept = (mask if mask is not None else torch.ones_like(ids)).bool()
            expected, got = expected[kept].float(), got[kept].float()
            tolerance = 1e-4 * max(1.0, float(expected.nan_to_num(0.0, 0.0, 0.0).abs().max()))
            if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=tolerance,
                                                                 equal_nan=True):
                diff = (got - expected).abs().max() if got.shape == expected.shape else "shape"
                given = ("padded, with its mask" if mask is padded else
                         "without padding, with a mask of ones" if mask is not None else "without a mask")
                if not bool(expected.isfinite().all()):
                    raise ValueError(f"{_family(model)}: the model's own forward gives non-finite logits "
                                     f"on a test batch {given} (and the layers differ from it), so whether "
                                     "the layers compute its function cannot be checked: run it in a "
                                     "precision and attention implementation that keep a padded row "
                                     "finite")
                raise ValueError(f"{_family(model)} cannot be pipelined by causal_lm_layers: its forward "
                                 f"computes something the layers do not (largest logit difference {diff} "
                                 f"on a test batch {given}); it is not embed -> blocks -> norm -> head "
                                 f"with the scalings read off the model. {WRITE_YOUR_OWN}")
        dropouts = _dropout_settings(model.config)
        if dropouts:
            model.train()
            layers.train()
            random_model, random_layers = _varies_with_seed(
                lambda: _both_logits(model, layers, ids, padded), weight.device)
            if random_model != random_layers:
                raise ValueError(f"{_family(model)} cannot be pipelined by causal_lm_layers: in training "
                                 f"its forward is {'' if random_model else 'not '}random and the layers "
                                 f"are {'' if random_layers else 'not '}(its config asks for "
                                 f"{', '.join(dropouts)}): a dropout the forward applies outside its "
                                 "modules is not read off the model; set those to 0 to pipeline it")
    finally:
        for m, training in modes.items():
            m.training = training


#: What a refused family can do instead (the end of a refusal that names no setting to change).
WRITE_YOUR_OWN = ("GPipe takes any sequence of layers: write the model's forward as an nn.Sequential of "
                  "its modules, each layer taking and returning what flows between them (e.g. "
                  "(hidden, attention_mask)), as gpipe_repro.models.hf's TokenEmbedding, DecoderBlock "
                  "and LMHead do for the families it reads, and check its logits against model(...)")


def _family(model: Any) -> str:
    return f"{type(model).__name__} ({model.config.model_type})"


def _both_logits(model: Any, layers: nn.Sequential, ids: torch.Tensor,
                 mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`model`'s logits and the layers', without gradients."""
    with torch.no_grad():
        try:
            expected = model(input_ids=ids, attention_mask=mask).logits
        except Exception as e:  # noqa: BLE001 - the model's own code, before any layer of ours
            reason = (str(e).strip().splitlines() or [""])[0]
            raise ValueError(f"{_family(model)}: the model's own forward failed on a test batch of "
                             f"{tuple(ids.shape)} token ids {'with' if mask is not None else 'without'} "
                             f"a mask ({type(e).__name__}: {reason}), before any pipelining: check its "
                             "config (sizes the family cannot take together)") from e
        got: Any = ids if mask is None else (ids, mask)
        try:
            for layer in layers:
                got = layer(got)
        except Exception as e:   # the block takes its inputs otherwise than the family's forward
            raise ValueError(f"{_family(model)} cannot be pipelined by causal_lm_layers: its blocks fail "
                             f"when called as the flattener calls them ({type(e).__name__}: {e}). "
                             f"{WRITE_YOUR_OWN}") from e
    return expected, got


def _dropout_settings(config: Any) -> list[str]:
    """The config's settings that make training random, above 0, as ``name=value``: dropout
    probabilities, and a mixture of experts' router jitter (Mixtral's ``router_jitter_noise``,
    PhiMoE's sampled routing), which is random in training as dropout is."""
    return [f"{k}={v}" for k, v in sorted(vars(config).items())
            if any(word in k for word in ("dropout", "pdrop", "jitter")) and isinstance(v, float) and v > 0]


def _varies_with_seed(run: Callable[[], tuple[torch.Tensor, ...]], device: torch.device) -> list[bool]:
    """Whether each of `run`'s results differs under two seeds (the caller's RNG states kept, the
    CPU's and `device`'s)."""
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(1)
        first = run()
        torch.manual_seed(2)
        second = run()
    return [not torch.equal(a, b) for a, b in zip(first, second)]
