"""A float64 model trains in float64: the pipeline's loss, gradients and updates agree with plain
float64 training to float64 rounding, not to float32's (the loss is upcast only from fp16/bf16)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe


def double_mlp() -> list[nn.Module]:
    torch.manual_seed(0)
    return [layer.double() for layer in (nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                         nn.Linear(16, 3))]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("m", [1, 3])
def test_silent_float64_model_trains_in_float64(k: int, m: int) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g))
            for _ in range(2)]
    layers = double_mlp()
    plain = nn.Sequential(*copy.deepcopy(layers))
    opt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    pipe = GPipe(layers, partitions=k, micro_batches=m, loss_fn=nn.CrossEntropyLoss(), cost="params",
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9))
    for x, y in data:
        loss = pipe.train_step(x, y)
        opt.zero_grad()
        ref = nn.functional.cross_entropy(plain(x), y)
        ref.backward()
        opt.step()
        assert ref.dtype == torch.float64
        assert loss == pytest.approx(float(ref.detach()), rel=1e-12, abs=1e-14)
    for (name, p), q in zip(pipe.unpartitioned().named_parameters(), plain.parameters()):
        assert p.dtype == torch.float64 and p.grad is not None and p.grad.dtype == torch.float64
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=lambda s, n=name: f"{n}: {s}")
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-14,
                                   msg=lambda s, n=name: f"{n}: {s}")
