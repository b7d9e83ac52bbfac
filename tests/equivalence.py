"""The plain-PyTorch reference every pipeline is compared against.

`reference_step` trains the same layers without any engine code: a loop over the micro-batches
(`tensor_split`), each layer seeded exactly as the engine seeds it (`gpipe_repro.engine.rng.seed_layer`),
the loss of micro-batch m weighted by n_m / N (mean) or 1 (sum), gradients accumulated, one optimizer
step. With M = 1 and no dropout it is ordinary full-batch training.

`assert_same_training` builds a GPipe and the reference from one model, runs one step on each, and
compares the loss, every parameter's gradient and every parameter after the update.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.engine.microbatch import split
from gpipe_repro.engine.rng import seed_layer

RTOL, ATOL = 1e-5, 1e-6


def reference_step(layers: list[nn.Module], inputs: Any, targets: Any, loss_fn: Callable,
                   micro_batches: int, lr: float = 0.1, seed: int = 0, step: int = 0,
                   loss_reduction: str = "mean") -> float:
    params = [p for layer in layers for p in layer.parameters()]
    for p in params:
        p.grad = None
    xs, ts = split(inputs, micro_batches), split(targets, micro_batches)
    n = sum(t.shape[0] if isinstance(t, torch.Tensor) else t[0].shape[0] for t in ts)
    total = 0.0
    for m, (x, t) in enumerate(zip(xs, ts)):
        h = x
        for i, layer in enumerate(layers):
            seed_layer(seed, step, i, m)
            h = layer(h)
        size = (t if isinstance(t, torch.Tensor) else t[0]).shape[0]
        loss = loss_fn(h, t) * (size / n if loss_reduction == "mean" else 1.0)
        loss.backward()
        total += loss.item()
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= lr * p.grad
    return total


def assert_same_training(layers: list[nn.Module], inputs: Any, targets: Any, loss_fn: Callable,
                         partitions: int, micro_batches: int, checkpoint: str,
                         loss_reduction: str = "mean", rtol: float = RTOL, atol: float = ATOL,
                         **gpipe_kwargs: Any) -> GPipe:
    """One training step of GPipe vs the reference; compare loss, grads and updated weights."""
    ref_layers = copy.deepcopy(layers)
    pipe = GPipe(copy.deepcopy(layers), partitions=partitions, micro_batches=micro_batches,
                 checkpoint=checkpoint, loss_fn=loss_fn, loss_reduction=loss_reduction,
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), **gpipe_kwargs)
    loss = pipe.train_step(inputs, targets)
    ref_loss = reference_step(ref_layers, inputs, targets, loss_fn, micro_batches,
                              loss_reduction=loss_reduction)
    where = f"K={partitions} M={micro_batches} checkpoint={checkpoint}"
    torch.testing.assert_close(torch.tensor(loss), torch.tensor(ref_loss), rtol=rtol, atol=atol,
                               msg=lambda m: f"loss differs ({where}): {m}")
    ours = dict(pipe.unpartitioned().named_parameters())
    theirs = dict(nn.Sequential(*ref_layers).named_parameters())
    assert ours.keys() == theirs.keys()
    for name in ours:
        g, rg = ours[name].grad, theirs[name].grad
        assert (g is None) == (rg is None), f"{name}: gradient presence differs ({where})"
        if g is not None:
            torch.testing.assert_close(g, rg, rtol=rtol, atol=atol,
                                       msg=lambda m: f"grad of {name} differs ({where}): {m}")
        torch.testing.assert_close(ours[name].detach(), theirs[name].detach(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"updated {name} differs ({where}): {m}")
    return pipe
