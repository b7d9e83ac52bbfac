"""Optimizers, learning-rate schedules and losses of the training runs (gpipe_repro/train/optim.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from gpipe_repro.train.optim import (
    OptimizerConfig,
    RMSpropTF,
    ScheduledLR,
    lr_function,
    optimizer_factory,
    parameter_groups,
    smoothed_cross_entropy,
    topk_correct,
)


def test_rmsprop_tf_matches_tensorflows_update_written_out_in_numpy() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5, dtype=torch.float64))
    grads = [torch.randn(5, dtype=torch.float64) for _ in range(4)]
    lrs = [0.1, 0.05, 0.05, 0.2]          # the rate changes: TF applies it before the momentum
    opt = RMSpropTF([w], lr=0.1, decay=0.9, momentum=0.9, eps=1.0, weight_decay=0.01)
    ref_w, ms, mom = w.detach().numpy().copy(), np.ones(5), np.zeros(5)
    for g, lr in zip(grads, lrs):
        w.grad = g.clone()
        opt.param_groups[0]["lr"] = lr
        opt.step()
        g_np = g.numpy() + 0.01 * ref_w
        ms = 0.9 * ms + 0.1 * g_np ** 2
        mom = 0.9 * mom + lr * g_np / np.sqrt(ms + 1.0)
        ref_w = ref_w - mom
    np.testing.assert_allclose(w.detach().numpy(), ref_w, rtol=1e-12)
    # and it is not torch's RMSprop (epsilon outside the root, mean square from 0)
    w2 = nn.Parameter(torch.zeros(5, dtype=torch.float64))
    torch_opt = torch.optim.RMSprop([w2], lr=0.1, alpha=0.9, momentum=0.9, eps=1.0)
    w2.grad = grads[0].clone()
    torch_opt.step()
    w3 = nn.Parameter(torch.zeros(5, dtype=torch.float64))
    tf_opt = RMSpropTF([w3], lr=0.1)
    w3.grad = grads[0].clone()
    tf_opt.step()
    assert not torch.allclose(w2, w3)


def test_weight_decay_skips_biases_and_norm_parameters() -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2))
    groups = parameter_groups(model.parameters(), 0.1)
    decayed, plain = groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {p.ndim for p in decayed["params"]} == {2, 4} and {p.ndim for p in plain["params"]} == {1}
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    for name in ("rmsprop", "rmsprop-torch", "sgd", "adam", "adamw"):
        opt = optimizer_factory(OptimizerConfig(name=name, lr=0.01, weight_decay=0.1))(model.parameters())
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_exponential_schedule_warms_up_then_decays_by_staircase() -> None:
    fn = lr_function(OptimizerConfig(lr=0.4, schedule="exponential", warmup_steps=4, decay_rate=0.5,
                                     decay_steps=3))
    assert [fn(s) for s in range(4)] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert [fn(s) for s in range(4, 11)] == pytest.approx([0.4, 0.4, 0.4, 0.2, 0.2, 0.2, 0.1])


def test_inverse_sqrt_and_cosine_schedules() -> None:
    inv = lr_function(OptimizerConfig(lr=1.0, schedule="inverse_sqrt", warmup_steps=100))
    assert inv(49) == pytest.approx(0.5) and inv(99) == pytest.approx(1.0)
    assert inv(399) == pytest.approx(0.5)                    # sqrt(100 / 400)
    cos = lr_function(OptimizerConfig(lr=2.0, schedule="cosine", warmup_steps=0, total_steps=10))
    assert cos(0) == pytest.approx(2.0) and cos(5) == pytest.approx(1.0) and cos(10) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="total_steps"):
        OptimizerConfig(schedule="cosine", warmup_steps=5, total_steps=5)
    with pytest.raises(ValueError, match="unknown optimizer"):
        OptimizerConfig(name="lamb")


def test_scheduled_lr_sets_every_cell_optimizer_and_restores_from_its_state() -> None:
    cells = [nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)]
    factory = optimizer_factory(OptimizerConfig(name="sgd", lr=1.0, weight_decay=1e-4))
    optimizers = [factory(c.parameters()) for c in cells] + [None]   # a cell without parameters
    fn = lr_function(OptimizerConfig(lr=1.0, schedule="exponential", decay_rate=0.5, decay_steps=1))
    schedule = ScheduledLR(optimizers, fn)
    assert schedule.apply(3) == pytest.approx(0.125)
    assert {g["lr"] for o in optimizers if o for g in o.param_groups} == {0.125}
    fresh = [factory(c.parameters()) for c in cells]
    restored = ScheduledLR(fresh, fn)
    restored.load_state_dict(schedule.state_dict())
    assert {g["lr"] for o in fresh for g in o.param_groups} == {0.125}


def test_label_smoothing_and_topk() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 5.0]])
    target = torch.tensor([0, 1])
    plain = smoothed_cross_entropy(logits, target)
    smooth = smoothed_cross_entropy(logits, target, 0.1)
    logp = logits.log_softmax(-1)
    expected = -(0.9 * logp.gather(1, target[:, None]).squeeze(1) + 0.1 * logp.mean(-1)).mean()
    assert smooth.item() == pytest.approx(expected.item())
    assert plain.item() == pytest.approx(nn.functional.cross_entropy(logits, target).item())
    padded = smoothed_cross_entropy(logits, torch.tensor([0, -100]), reduction="sum")
    assert padded.item() == pytest.approx(-logp[0, 0].item())
    assert topk_correct(logits, target, (1, 2, 5)) == {1: 1, 2: 2, 5: 2}
    assert math.isclose(topk_correct(torch.eye(10), torch.arange(10), (1,))[1], 10)
