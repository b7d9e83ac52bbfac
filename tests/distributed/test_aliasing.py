"""Tensors of one boundary value that share memory stay shared between stage processes.

Two stage processes (gloo, CPU): a layer returns ``(h, h, h.t(), ids, 0.5)`` and the next process's
first layer writes into ``t[0]`` and ``t[2]`` in place (tests/engine/test_aliasing.py). Each rank
compares its cell's loss, gradients and updated weights, after two steps (the first agrees on the
boundary specs, the second runs on them with receives posted early), with plain PyTorch.
"""
from __future__ import annotations

import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.distributed import launch_local
from tests.engine.test_aliasing import batch, layers
from tests.equivalence import ATOL, RTOL, reference_step


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def train_aliased_like_plain() -> list[str]:
    """Runs on every rank: gpipe and zb-h1 against the reference; returns what it checked."""
    checked = []
    x, y = batch()
    for schedule, checkpoint in (("gpipe", "always"), ("zb-h1", "never")):
        pipe = GPipe(layers(), runtime="distributed", partitions=2, balance=[2, 2], micro_batches=2,
                     checkpoint=checkpoint, schedule=schedule, loss_fn=nn.MSELoss(),
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        ref = layers()
        rank = pipe.rank
        assert rank is not None
        mine, theirs = pipe.cells[rank], ref[2 * rank:2 * rank + 2]
        for step in range(2):
            where = f"{schedule} checkpoint={checkpoint} rank {rank} step {step}"
            loss = pipe.train_step(x, y)
            _close(torch.tensor(loss), torch.tensor(reference_step(ref, x, y, nn.MSELoss(), 2, step=step)),
                   f"{where}: loss")
            named = list(mine.named_parameters())
            assert named, f"{where}: nothing to compare"
            for (name, p), r in zip(named, nn.Sequential(*theirs).parameters()):
                assert p.grad is not None and r.grad is not None, f"{where}: {name} has no gradient"
                _close(p.grad, r.grad, f"{where}: grad of {name}")
                _close(p.detach(), r.detach(), f"{where}: updated {name}")
        pipe.eval()
        with torch.no_grad():
            _close(pipe.forward(x), nn.Sequential(*ref).eval()(x), f"{schedule}: eval forward")
        checked.append(schedule)
    return checked


def test_silent_aliased_tuple_items_stay_aliased_between_stage_processes() -> None:
    results = launch_local(train_aliased_like_plain, 2, timeout=20)
    assert results == [["gpipe", "zb-h1"], ["gpipe", "zb-h1"]]
