"""Loss semantics you cannot get wrong, and the smaller API guarantees."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpipe_repro import GPipe
from tests.equivalence import assert_same_training, sgd


def mlp() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]


def data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


# -- loss semantics --------------------------------------------------------------------------------
def test_silent_mis_scaling_sum_loss_reads_its_reduction() -> None:
    x, y = data()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    full = loss_fn(nn.Sequential(*mlp())(x), y).detach()
    pipe = GPipe(mlp(), partitions=2, micro_batches=4, loss_fn=loss_fn, optimizer=None)
    assert pipe.loss_reduction == "sum"
    assert pipe.train_step(x, y) == pytest.approx(float(full), rel=1e-6)


def test_silent_mis_scaling_contradicting_reduction_is_refused() -> None:
    with pytest.raises(ValueError, match=r"reduction='sum' but loss_reduction='mean': leave loss_reduction "
                                         r"out.*or build the loss with reduction='mean'"):
        GPipe(mlp(), partitions=2, loss_fn=nn.CrossEntropyLoss(reduction="sum"), loss_reduction="mean")


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


def token_sum_count(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token loss and the number of non-padding tokens (pad id 0)."""
    return (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=0, reduction="sum"),
            (labels != 0).sum())


def padded_lm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 12, (7, 6), generator=g)
    labels = torch.randint(1, 12, (7, 6), generator=g)
    for i, length in enumerate([6, 1, 2, 6, 3, 5, 1]):   # very uneven padding per example
        labels[i, length:] = 0
    return ids, labels


@pytest.mark.parametrize("k, m", [(2, 3), (3, 7)])
def test_silent_mis_scaling_padded_token_mean_equals_full_batch(k: int, m: int) -> None:
    torch.manual_seed(0)
    layers = [TinyLM(), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 12)]
    ids, labels = padded_lm_batch()
    plain = nn.Sequential(*copy.deepcopy(layers))
    full = F.cross_entropy(plain(ids).flatten(0, 1), labels.flatten(), ignore_index=0)
    full.backward()
    pipe = GPipe(copy.deepcopy(layers), partitions=k, micro_batches=m, loss_fn=token_sum_count,
                 optimizer=None)
    assert pipe.train_step(ids, labels) == pytest.approx(float(full.detach()), rel=1e-6)
    for p, q in zip(pipe.unpartitioned().parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    # and over several steps with an optimizer, against the independent reference
    assert_same_training(layers, ids, labels, token_sum_count, partitions=k, micro_batches=m,
                         checkpoint="always", steps=3, optimizer=sgd)


def test_sum_count_loss_with_no_tokens_is_refused_before_any_update() -> None:
    ids, labels = padded_lm_batch()
    pipe = GPipe([TinyLM(), nn.Linear(8, 12)], partitions=2, micro_batches=2, loss_fn=token_sum_count,
                 optimizer=sgd)
    before = copy.deepcopy(pipe.state_dict())
    with pytest.raises(ValueError, match="counts add up to 0 .*positive total count"):
        pipe.train_step(ids, torch.zeros_like(labels))
    assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items()) and pipe.step == 0


def test_loss_returning_a_bad_tuple() -> None:
    pipe = GPipe(mlp(), partitions=2, micro_batches=2, loss_fn=lambda out, y: (out.sum(), 1, 2),
                 optimizer=None)
    with pytest.raises(TypeError, match=r"tuple of 3.*\(sum, count\)"):
        pipe.train_step(*data())


# -- smaller findings -------------------------------------------------------------------------------
def test_forward_in_training_mode_draws_fresh_dropout_masks() -> None:
    torch.manual_seed(0)
    pipe = GPipe([nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 4)], partitions=2, micro_batches=2,
                 optimizer=None)
    x, _ = data()
    a, b = pipe(x), pipe(x)
    assert not torch.equal(a, b), "two training-mode forwards drew the same masks"
    pipe.eval()
    assert torch.equal(pipe(x), pipe(x))


def test_to_moves_the_device_list_too() -> None:
    pipe = GPipe(mlp(), partitions=3, micro_batches=2, optimizer=None)
    pipe.to("meta")
    assert pipe.devices == [torch.device("meta")] * 3
    assert [e.device for e in pipe.executors] == pipe.devices
    assert all(p.device.type == "meta" for p in pipe.parameters())


def test_forward_with_more_micro_batches_than_examples() -> None:
    pipe = GPipe(mlp(), partitions=2, micro_batches=8, optimizer=None)
    x, _ = data(n=3)
    with pytest.raises(ValueError, match="micro_batches=8 is larger than the batch size 3 in training mode"):
        pipe(x)
    pipe.eval()
    expected = nn.Sequential(*mlp()).eval()(x)
    torch.testing.assert_close(pipe(x), expected)   # eval: min(M, N) micro-batches, same output


def test_optimizer_left_out_is_an_error_none_means_gradients_only() -> None:
    x, y = data()
    with pytest.raises(ValueError,
                       match="train_step needs an optimizer.*optimizer=None to compute gradients"):
        GPipe(mlp(), partitions=2, loss_fn=nn.CrossEntropyLoss()).train_step(x, y)
    pipe = GPipe(mlp(), partitions=2, loss_fn=nn.CrossEntropyLoss(), optimizer=None)
    before = copy.deepcopy(pipe.state_dict())
    pipe.train_step(x, y)
    assert all(p.grad is not None for p in pipe.parameters())
    assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())


def test_configuration_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        GPipe(mlp(), 2)  # type: ignore[misc]
