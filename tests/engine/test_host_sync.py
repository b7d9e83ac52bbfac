"""Host reads per training step of the local runtime: the host never waits for the device unless the
caller asks for a number, except where gpipe_repro.engine.agreement says (fp16's overflow verdict, a
(sum, count) loss's total count: one read each step, both together when both apply).

On the CPU there is no device to wait for, so the test counts what would be a wait on a GPU: every
read of a tensor's value into Python (``item``, ``float``, ``int``, ``bool``, ``tolist``, ...) made
while the step runs.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe

READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "__complex__")


class HostReads:
    """Counts reads of tensor values into Python while active (:meth:`counting`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, self.active, self.where = 0, False, []   # type: ignore[var-annotated]
        for name in READS:
            real = getattr(torch.Tensor, name)

            def read(t: torch.Tensor, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
                if self.active:
                    self.count += 1
                    self.where.append(_name)
                return _real(t, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, read)

    @contextmanager
    def counting(self) -> Iterator[None]:
        self.count, self.where, self.active = 0, [], True
        try:
            yield
        finally:
            self.active = False


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> HostReads:
    return HostReads(monkeypatch)


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True), nn.Dropout(0.1),
            nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)]


def sum_count(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A token-style (sum, count) loss: the count is a tensor, as a padding mask's sum would be."""
    return nn.functional.mse_loss(out, y, reduction="sum"), torch.tensor(float(y.numel()))


def pipe_for(precision: str = "fp32", loss: Any = None, **kwargs: Any) -> GPipe:
    return GPipe(layers(), partitions=3, micro_batches=4, balance=[2, 3, 2],
                 loss_fn=loss or nn.MSELoss(), precision=precision, clip_grad_norm=0.5,
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), **kwargs)


def batch(classes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, generator=g)
    return x, (torch.randint(0, 4, (8,), generator=g) if classes else torch.randn(8, 4, generator=g))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_reads_nothing_from_the_device(reads: HostReads, schedule: str, precision: str) -> None:
    """fp32 and bf16 with global clipping, BatchNorm, dropout and an in-place layer: no read, every
    schedule (the zero-bubble split included)."""
    pipe = pipe_for(precision, schedule=schedule)
    x, y = batch()
    for _ in range(2):      # the first step learns the in-place rule; the second is the steady state
        with reads.counting():
            loss = pipe.train_step(x, y, sync=False)
        assert reads.count == 0, reads.where
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    with reads.counting():
        assert pipe.last_grad_norm is not None and not pipe.last_step_skipped
    assert reads.count == 1, "the norm is read when asked for, once; skipped needs no read without fp16"


def test_cross_entropys_exact_mean_reads_nothing(reads: HostReads) -> None:
    """Cross-entropy's mean over the targets that count: its denominator stays a tensor."""
    pipe = pipe_for(loss=nn.CrossEntropyLoss(ignore_index=3))
    x, y = batch(classes=True)
    with reads.counting():
        pipe.train_step(x, y, sync=False)
    assert reads.count == 0, reads.where


def test_sync_true_reads_the_loss_once(reads: HostReads) -> None:
    pipe = pipe_for()
    x, y = batch()
    with reads.counting():
        loss = pipe.train_step(x, y)
    assert isinstance(loss, float) and reads.count == 1, reads.where


@pytest.mark.parametrize(("precision", "loss"), [("fp16", None), ("fp32", sum_count), ("fp16", sum_count)],
                         ids=["fp16", "sum-count", "fp16-sum-count"])
def test_the_documented_reads_happen_once_per_step(reads: HostReads, precision: str, loss: Any) -> None:
    """fp16 reads its overflow verdict, a (sum, count) loss its total count: once per step whatever K,
    both in one read. (A (sum, count) function's first calls are checked to add up over rows, which
    reads the device, as the first step's other loss checks do: the steady state begins after.)"""
    pipe = pipe_for(precision, loss)
    x, y = batch()
    for step in range(3):
        with reads.counting():
            pipe.train_step(x, y, sync=False)
        if step > 0 or loss is None:
            assert reads.count == 1, reads.where
    with reads.counting():
        assert isinstance(pipe.last_step_skipped, bool)
    assert reads.count == 0, "the verdict read during the step is kept"


def test_the_tensor_loss_equals_the_synchronized_one() -> None:
    a, b = pipe_for(), pipe_for()
    x, y = batch()
    for _ in range(3):
        assert float(a.train_step(x, y, sync=False)) == b.train_step(x, y)
    assert a.last_grad_norm == b.last_grad_norm
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_silent_zero_count_still_refused_before_any_update() -> None:
    """A (sum, count) loss whose counts add up to 0 would make every gradient inf: the count is read
    at AGREE and the step refused before any cell updates."""
    pipe = pipe_for(loss=lambda out, y: (out.sum() * 0, torch.tensor(0.0)))
    before = copy.deepcopy(pipe.state_dict())
    with pytest.raises(ValueError, match="counts add up to 0"):
        pipe.train_step(*batch(), sync=False)
    for k, v in pipe.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("training", [True, False])
def test_inference_reads_nothing_from_the_device(reads: HostReads, training: bool) -> None:
    pipe = pipe_for().train(training)
    x, _ = batch()
    with reads.counting():
        out = pipe(x)
    assert reads.count == 0, reads.where
    assert out.shape == (8, 4)
