"""The AGREE step in the distributed runtime: one process per stage agrees like the local runtime.

Global clipping, the fp16 overflow verdict, in-place layers at a cut and the all-or-nothing step
behave as in one process (which tests/engine/test_steps.py compares with plain PyTorch).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.distributed import JobFailed, launch_local
from gpipe_repro.engine.schedule import ActionKind
from tests.engine.test_steps import batch, fail_at_last, model, sgd_momentum


def agree_like_local() -> list[str]:
    """Runs on every rank: distributed vs local with clipping (fp32), with fp16 + an injected
    overflow on stage 0, and with bf16 (bf16 activations cross the process boundary); cut right
    before ReLU(inplace=True)."""
    checked = []
    for options in ({"clip_grad_norm": 0.05}, {"precision": "fp16", "clip_grad_norm": 1.0},
                    {"precision": "bf16"}):
        kw = dict(partitions=2, micro_batches=3, balance=[2, 5], loss_fn=nn.CrossEntropyLoss(),
                  optimizer=sgd_momentum, checkpoint="except_last", **options)
        pipe = GPipe(model(), runtime="distributed", **kw)
        local = GPipe(model(), **kw)
        assert isinstance(local.cells[1][0], nn.ReLU) and local.cells[1][0].inplace
        rank = pipe.rank
        assert rank is not None
        state = {"step": 0}
        for p in (local, pipe) if options.get("precision") == "fp16" else ():
            if p.cells[0]:
                p.cells[0][0].weight.register_hook(
                    lambda g, state=state: g * float("inf") if state["step"] == 1 else g)
        for step in range(3):
            state["step"] = step
            x, y = batch(step)
            loss, ref = pipe.train_step(x, y), local.train_step(x, y)
            where = f"{options} step {step} rank {rank}"
            assert loss == pytest.approx(ref, rel=1e-6), where
            assert pipe.last_step_skipped == local.last_step_skipped == (
                step == 1 and options.get("precision") == "fp16"), where
            assert pipe.last_grad_norm == (None if local.last_grad_norm is None else
                                           pytest.approx(local.last_grad_norm, rel=1e-5, nan_ok=True)), where
            assert pipe.loss_scale == local.loss_scale, where
            for p, q in zip(pipe.cells[rank].parameters(), local.cells[rank].parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")
        checked.append(str(options))
    return checked


def test_distributed_clipping_and_fp16_overflow_agree_like_local() -> None:
    results = launch_local(agree_like_local, 2, timeout=20)
    assert [len(r) for r in results] == [3, 3]


def fail_in_second_step(marks: str) -> None:
    """Rank 0's last backward of step 2 raises; every rank marks each optimizer step it takes."""
    pipe = GPipe(model(), runtime="distributed", partitions=2, micro_batches=2, balance=[2, 5],
                 loss_fn=nn.CrossEntropyLoss(), optimizer=sgd_momentum)
    ex = pipe.executors[0]
    real = ex.handlers[ActionKind.OPTIMIZER_STEP]

    def marked(m: int | None) -> None:
        Path(marks, f"rank{ex.stage}-step{pipe.step}").touch()
        real(m)
    ex.handlers[ActionKind.OPTIMIZER_STEP] = marked
    pipe.train_step(*batch(1))
    if ex.stage == 0:
        fail_at_last(ex, ActionKind.BACKWARD, 2)
    pipe.train_step(*batch(2))


def test_half_applied_steps_distributed_no_rank_updates_when_one_fails() -> None:
    with tempfile.TemporaryDirectory() as marks:
        with pytest.raises(JobFailed) as info:
            launch_local(fail_in_second_step, 2, marks, timeout=5, grace=1.0)
        assert info.value.rank == 0 and "injected failure" in info.value.cause
        assert sorted(os.listdir(marks)) == ["rank0-step0", "rank1-step0"]
