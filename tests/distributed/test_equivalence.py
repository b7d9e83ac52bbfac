"""The distributed runtime trains exactly like the local runtime and like plain PyTorch.

2 and 3 stage processes (gloo, CPU, launched locally), uneven micro-batches, dropout, tuple
boundaries with integer and bool tensors, deferred BatchNorm, every checkpoint mode,
recompute-ahead, 1F1B, interleaved 1F1B (K=2 processes x v=2 cells each: a process runs two stages
and sends between processes by the same transport) and DualPipeV (2 processes x 2 cells in a V).
Each rank compares ITS cells' loss, gradients and updated weights, after two steps (the first agrees
on boundary specs, the second runs on the agreed specs with receives posted early), with a local
GPipe and with `reference_step` computed in the same process. Many configurations run in one launch
to keep the test fast; each rank returns what it checked so a vacuous pass is caught.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.distributed import JobFailed, launch_local
from tests.engine.test_equivalence import MODELS, data
from tests.equivalence import ATOL, RTOL, reference_step

# (model, micro-batches, checkpoint, recompute_ahead, schedule); batches have 11 examples.
CONFIGS = {
    2: [("mlp", 1, "never", False, "gpipe"), ("mlp", 3, "always", False, "gpipe"),
        ("mlp", 4, "except_last", False, "gpipe"), ("mlp", 4, "always", True, "gpipe"),
        ("mlp", 11, "never", False, "gpipe"), ("transformer", 3, "except_last", False, "gpipe"),
        ("transformer", 2, "never", False, "gpipe"), ("conv", 3, "always", True, "gpipe"),
        # interleaved: partitions = 2K cells, v=2 per process; M a multiple of K
        ("mlp", 4, "never", False, "interleaved"), ("mlp", 2, "always", True, "interleaved"),
        ("transformer", 4, "except_last", False, "interleaved"),
        # dualpipe-v: partitions = 2K cells in a V (cells 0 and 3 on process 0); M >= 2K
        ("mlp", 5, "except_last", True, "dualpipe-v")],
    3: [("mlp", 4, "always", True, "gpipe"), ("mlp", 3, "never", False, "gpipe"),
        ("transformer", 3, "always", False, "gpipe"), ("conv", 4, "except_last", False, "gpipe"),
        ("mlp", 4, "never", False, "1f1b")],
}
STEPS = 2


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_configs(k: int) -> list[str]:
    """Runs in every stage process: train each configuration three ways and compare this rank's
    cell. Returns the names of the configurations checked."""
    checked = []
    for kind, m, mode, ahead, schedule, *split in CONFIGS[k]:   # split: a zero-bubble split count
        build, loss_fn = MODELS[kind]
        x, y = data(kind)
        where = f"{kind} K={k} M={m} checkpoint={mode} ahead={ahead} {schedule} split={split}"
        cells = 2 * k if schedule in ("interleaved", "zb-v", "dualpipe-v") else k
        kwargs = dict(partitions=cells, micro_batches=m, checkpoint=mode, recompute_ahead=ahead,
                      schedule=schedule, loss_fn=loss_fn, cost="params",
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                      split_backwards=split[0] if split else None)
        pipe = GPipe(build(), runtime="distributed", **kwargs)
        local = GPipe(build(), **kwargs)
        ref = build()
        rank = pipe.rank
        assert rank is not None and pipe.balance == local.balance
        here = pipe.stages_here
        assert here == {"interleaved": [rank, rank + k], "zb-v": [rank, 2 * k - 1 - rank],
                        "dualpipe-v": [rank, 2 * k - 1 - rank]}.get(schedule, [rank]), here
        mine = [layer for s in here for layer in pipe.cells[s]]
        theirs = [ref[i] for s in here for i in range(sum(pipe.balance[:s]), sum(pipe.balance[:s + 1]))]
        local_params = [p for s in here for p in local.cells[s].parameters()]
        assert len(mine) == sum(pipe.balance[s] for s in here) and all(
            len(c) == 0 for s, c in enumerate(pipe.cells) if s not in here), "only this rank's cells are kept"
        for step in range(STEPS):
            loss = pipe.train_step(x, y)
            _close(torch.tensor(loss), torch.tensor(local.train_step(x, y)), f"{where}: loss vs local")
            ref_loss = reference_step(ref, x, y, loss_fn, m, step=step)
            _close(torch.tensor(loss), torch.tensor(ref_loss), f"{where}: loss vs reference")
            named = list(nn.Sequential(*mine).named_parameters())
            assert named and len(named) == len(local_params), f"{where}: nothing to compare"
            for (name, p), q, r in zip(named, local_params, nn.Sequential(*theirs).parameters()):
                assert (p.grad is None) == (r.grad is None), f"{where}: grad presence of {name}"
                if p.grad is not None:
                    _close(p.grad, q.grad, f"{where} step {step}: grad of {name} vs local")
                    _close(p.grad, r.grad, f"{where} step {step}: grad of {name} vs reference")
                _close(p.detach(), q.detach(), f"{where} step {step}: {name} vs local")
                _close(p.detach(), r.detach(), f"{where} step {step}: {name} vs reference")
        for buf, local_buf in zip([b for s in here for b in pipe.cells[s].buffers()],
                                  [b for s in here for b in local.cells[s].buffers()]):
            _close(buf.float(), local_buf.float(), f"{where}: BatchNorm buffers vs local")
        pipe.eval(), local.eval()
        _close(pipe.forward(x), local.forward(x), f"{where}: inference output vs local")
        checked.append(where)
    return checked


def test_two_stage_processes_train_like_local_and_plain() -> None:
    results = launch_local(check_configs, 2, 2, timeout=20)
    assert len(results) == 2 and all(len(r) == len(CONFIGS[2]) for r in results)


def test_three_stage_processes_train_like_local_and_plain() -> None:
    results = launch_local(check_configs, 3, 3, timeout=20)
    assert len(results) == 3 and all(len(r) == len(CONFIGS[3]) for r in results)


def train_with_rank_dependent_batch() -> float:
    build, loss_fn = MODELS["mlp"]
    x, y = data("mlp", n=11 + int(os.environ["RANK"]))  # wrong on purpose: ranks must get the same inputs
    pipe = GPipe(build(), partitions=2, micro_batches=2, loss_fn=loss_fn, optimizer=None,
                 runtime="distributed")
    return pipe.train_step(x, y)


def test_ranks_given_different_inputs_fail_with_a_clear_error() -> None:
    try:
        launch_local(train_with_rank_dependent_batch, 2, timeout=10)
    except JobFailed as e:
        assert "rank 1 and rank 0 were given different mini-batches" in str(e) or \
            "rank 0 and rank 1 were given different mini-batches" in str(e), str(e)
    else:
        raise AssertionError("ranks with different input shapes were not detected")


class StepCounter(nn.Module):
    """Passes a plain int that changes every step across the boundary: not a function of shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.calls += 1
        return x, self.calls


class TakeFirst(nn.Module):
    def forward(self, x: tuple[torch.Tensor, int]) -> torch.Tensor:
        return x[0]


def train_with_changing_plain_value() -> float:
    layers = [nn.Linear(6, 6), StepCounter(), TakeFirst(), nn.Linear(6, 3)]
    x, y = data("mlp")
    pipe = GPipe(layers, partitions=2, balance=[2, 2], micro_batches=1,
                 loss_fn=nn.CrossEntropyLoss(), optimizer=None, runtime="distributed")
    return [pipe.train_step(x, y) for _ in range(2)][-1]


def test_boundary_value_that_changes_between_steps_is_refused() -> None:
    try:
        launch_local(train_with_changing_plain_value, 2, timeout=10)
    except JobFailed as e:
        assert e.rank == 0 and "must be a function of the input shapes" in str(e)
    else:
        raise AssertionError("a plain boundary value that changed between steps was not detected")
