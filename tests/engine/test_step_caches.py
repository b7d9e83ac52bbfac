"""What the engine computes once per configuration instead of once per step is rebuilt when the
configuration changes: the training schedule (schedule, K, M, checkpoint, recompute_ahead), each
executor's checkpointed and split micro-batches, and AGREE's contributions kept by name."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.engine.agreement import AGREEMENT_FIELDS, Contribution, StepConfig
from gpipe_repro.engine.schedule import make_schedule
from tests.equivalence import reference_train, sgd


class Recorder(nn.Module):
    """An identity layer recording, per call, the batch size and whether autograd was on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((x.shape[0], torch.is_grad_enabled()))
        return x


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 8), nn.ReLU(), Recorder(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)]


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def pipe_for(**kw: Any) -> tuple[GPipe, Recorder]:
    pipe = GPipe(layers(), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, **kw)
    recorder = next(m for m in pipe.modules() if isinstance(m, Recorder))
    return pipe, recorder


@pytest.mark.parametrize("partitions", [1, 2])
def test_a_changed_checkpoint_mode_runs_on_the_next_step(partitions: int) -> None:
    """checkpoint="never" keeps the forward's graph; switched to "always", the next step's forward
    runs without autograd and the recompute with it; and back."""
    pipe, rec = pipe_for(partitions=partitions, micro_batches=2, checkpoint="never")
    x, y = batch()
    pipe.train_step(x, y)
    assert rec.calls == [(4, True), (4, True)]
    rec.calls.clear()
    pipe.checkpoint = "always"
    pipe.train_step(x, y)
    assert sorted(rec.calls) == [(4, False), (4, False), (4, True), (4, True)]
    rec.calls.clear()
    pipe.checkpoint = "never"
    pipe.train_step(x, y)
    assert rec.calls == [(4, True), (4, True)]


def test_a_changed_micro_batch_count_runs_on_the_next_step_and_equals_plain_training() -> None:
    pipe, rec = pipe_for(partitions=2, micro_batches=1, checkpoint="except_last")
    reference = copy.deepcopy(layers())
    x, y = batch()
    pipe.train_step(x, y)
    assert [n for n, _ in rec.calls] == [8]
    rec.calls.clear()
    pipe.micro_batches = 4
    assert pipe.make_schedule().num_microbatches == 4
    pipe.train_step(x, y)
    assert sorted(n for n, grad in rec.calls if grad) == [2, 2, 2, 2]
    reference_train(reference, [(x, y)], nn.CrossEntropyLoss(), 1, sgd)
    reference_train(reference, [(x, y)], nn.CrossEntropyLoss(), 4, sgd, first_step=1)
    for ours, theirs in zip(pipe.unpartitioned().parameters(), nn.Sequential(*reference).parameters()):
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)


def test_make_schedule_follows_every_setting_it_is_built_from() -> None:
    pipe, _ = pipe_for(partitions=2, micro_batches=2, checkpoint="never")
    first = pipe.make_schedule()
    assert pipe.make_schedule() is first          # built once per configuration
    changes = [("schedule_name", "1f1b"), ("micro_batches", 4), ("checkpoint", "always"),
               ("recompute_ahead", True), ("schedule_name", "zb-h1")]
    for name, value in changes:
        setattr(pipe, name, value)
        expected = make_schedule(pipe.schedule_name, pipe.partitions, pipe.micro_batches,
                                 pipe.checkpoint, pipe.recompute_ahead)
        assert pipe.make_schedule() == expected, name
        pipe.train_step(*batch())                 # and the executors run it


def test_a_split_schedule_after_a_plain_one_freezes_a_layer_between_steps() -> None:
    """gpipe then zb-h1 (split backward), with a layer frozen between the two: the frozen weight
    stays, the others train."""
    pipe, _ = pipe_for(partitions=2, micro_batches=2, checkpoint="never")
    x, y = batch()
    pipe.train_step(x, y)
    pipe.schedule_name = "zb-h1"
    first = pipe.unpartitioned()[0]
    first.weight.requires_grad_(False)
    frozen = first.weight.detach().clone()
    last = pipe.unpartitioned()[-1].weight.detach().clone()
    pipe.train_step(x, y)
    assert first.weight.grad is None and torch.equal(first.weight, frozen)
    assert not torch.equal(pipe.unpartitioned()[-1].weight, last)


def test_train_eval_and_forward_between_steps_reread_the_schedule() -> None:
    pipe, rec = pipe_for(partitions=2, micro_batches=2, checkpoint="always")
    x, y = batch()
    pipe.train_step(x, y)
    pipe.eval()
    pipe(x)
    pipe.train()
    rec.calls.clear()
    pipe.train_step(x, y)
    assert sorted(rec.calls) == [(4, False), (4, False), (4, True), (4, True)]


def stacked(device: torch.device, **named: torch.Tensor) -> torch.Tensor:
    """A contribution's vector as the fields say it is: missing numbers are 0."""
    return torch.stack([named.get(n, torch.zeros((), dtype=torch.float64)).to(device, torch.float64)
                        for n in AGREEMENT_FIELDS])


def test_contributions_by_name_equal_their_vectors_and_add_like_them() -> None:
    cpu = torch.device("cpu")
    loss, count, sq = torch.tensor(1.5), torch.tensor(3.0), torch.tensor(4.0, dtype=torch.float64)
    a = Contribution.of(cpu, grad_sq_norm=sq, nonfinite=torch.tensor(0.0))
    b = Contribution.of(cpu, loss=loss, count=count)
    assert torch.equal(a.vector, stacked(cpu, grad_sq_norm=sq, nonfinite=torch.tensor(0.0)))
    total = Contribution.total([a, b])
    assert total.counted is True
    expected = a.vector + b.vector
    assert torch.equal(total.vector, expected)
    for name in AGREEMENT_FIELDS:
        assert torch.equal(total.field(name), expected[AGREEMENT_FIELDS.index(name)]), name
    # a vector (an all-reduce's result) added to one kept by name
    mixed = Contribution(expected.clone()) + a
    assert torch.equal(mixed.vector, expected + a.vector)
    assert torch.equal(total.without_norm().vector, expected * torch.tensor([1, 1, 1, 0, 1.0],
                                                                            dtype=torch.float64))
    with pytest.raises(ValueError, match="not one of"):
        b.field("bogus")


@pytest.mark.parametrize("config", [StepConfig(), StepConfig(clip_grad_norm=1.0),
                                    StepConfig("fp16", None, 8.0), StepConfig("fp16", 0.5, 8.0)])
@pytest.mark.parametrize("counted", [False, True])
def test_an_agreement_from_named_numbers_equals_the_one_from_their_vector(config: StepConfig,
                                                                         counted: bool) -> None:
    cpu = torch.device("cpu")
    named = Contribution.total([
        Contribution.of(cpu, grad_sq_norm=torch.tensor(9.0), nonfinite=torch.tensor(0.0)),
        Contribution.of(cpu, loss=torch.tensor(2.5), count=torch.tensor(5.0) if counted else None,
                        grad_sq_norm=torch.tensor(16.0), nonfinite=torch.tensor(0.0))])
    ours = named.agreement(config)
    theirs = Contribution(named.vector.clone(), counted).agreement(config)
    for field in ("loss", "grad_norm", "factor", "skip"):
        a, b = getattr(ours, field), getattr(theirs, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert torch.equal(a, b), field


@pytest.mark.parametrize("partitions", [1, 2])
def test_silent_stale_optimizer_a_replaced_optimizer_is_the_one_that_steps(partitions: int) -> None:
    """``pipe.optimizers[s] = ...`` between steps: the new optimizer updates cell s (the executors
    used to keep stepping the one they were built with, silently)."""
    pipe, _ = pipe_for(partitions=partitions, micro_batches=2, checkpoint="never")
    x, y = batch()
    pipe.train_step(x, y)
    frozen = [torch.optim.SGD(cell.parameters(), lr=0.0) for cell in pipe.cells]
    pipe.optimizers[:] = frozen
    before = [p.detach().clone() for p in pipe.parameters()]
    pipe.train_step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))


def test_a_replica_not_counting_the_norm_zeroes_it_even_when_infinite() -> None:
    """The replica whose norm another one counts zeroed its field by multiplying, and inf * 0 is NaN:
    the agreed norm read NaN where the counting replica's (and plain PyTorch's) read inf."""
    cpu = torch.device("cpu")
    part = Contribution.of(cpu, loss=torch.tensor(2.0), count=torch.tensor(4.0),
                           grad_sq_norm=torch.tensor(float("inf"), dtype=torch.float64))
    kept = part.without_norm()
    assert kept.grad_sq_norm.item() == 0.0
    assert kept.field("loss").item() == 2.0 and kept.field("count").item() == 4.0
    assert torch.isfinite(kept.vector).all()
