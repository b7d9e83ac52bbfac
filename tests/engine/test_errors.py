"""Bad input gets a clear error that names the fix, and never corrupts the model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe


def layers(n: int = 4) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(4, 4) for _ in range(n)]


def make(**kw):
    kw.setdefault("loss_fn", nn.MSELoss())
    kw.setdefault("optimizer", None)
    return GPipe(kw.pop("model", layers()), **kw)


def test_more_partitions_than_layers() -> None:
    with pytest.raises(ValueError, match=r"partitions=5 is larger than the number of layers \(4\).*<= 4"):
        make(partitions=5)


@pytest.mark.parametrize("k", [0, -1])
def test_partitions_below_one(k: int) -> None:
    with pytest.raises(ValueError, match="partitions must be an integer >= 1"):
        make(partitions=k)


def test_micro_batches_below_one() -> None:
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
        make(micro_batches=0)


def test_micro_batches_larger_than_batch_leaves_weights_untouched() -> None:
    pipe = make(partitions=2, micro_batches=8, optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    before = copy.deepcopy(pipe.state_dict())
    with pytest.raises(ValueError,
                       match="micro_batches=8 is larger than the batch size 5: use micro_batches <= 5"):
        pipe.train_step(torch.randn(5, 4), torch.randn(5, 4))
    for k, v in pipe.state_dict().items():
        assert torch.equal(v, before[k])
    assert pipe.step == 0


@pytest.mark.parametrize("balance, match", [
    ([1, 1], "sums to 2 but the model has 4 layers"),
    ([4, 0], "has an empty cell"),
    ([1, 1, 2], "3 cells but partitions=2"),
])
def test_bad_balance(balance: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(partitions=2, balance=balance)


class ReturnsDict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict:
        return {"x": x}


class ReturnsObject(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple:
        return (x, object())


@pytest.mark.parametrize("bad, match", [(ReturnsDict(), "produced a dict.*Return a tuple"),
                                        (ReturnsObject(), "tuple holding a object")])
def test_unsupported_boundary_value(bad: nn.Module, match: str) -> None:
    pipe = make(model=[nn.Linear(4, 4), bad, nn.Identity()], partitions=2, balance=[1, 2])
    with pytest.raises(TypeError, match=match):
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4))


def test_devices_list_must_match_partitions() -> None:
    with pytest.raises(ValueError, match="3 devices given for partitions=2: give one device per partition"):
        make(partitions=2, devices=["cpu", "cpu", "cpu"])


def test_a_module_holding_a_tied_weight_in_two_cells() -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    make(model=[a, nn.ReLU(), b], partitions=2, balance=[2, 1])   # a tied parameter: one copy per cell
    shared = nn.Linear(4, 4)     # a module held by two layers: its weights are tied (test_repeated_modules)
    make(model=[nn.Sequential(shared), nn.ReLU(), nn.Sequential(shared)], partitions=2, balance=[2, 1])


def test_not_a_sequence() -> None:
    with pytest.raises(TypeError, match="nn.Sequential or a list of nn.Module"):
        GPipe(nn.Linear(4, 4))


def test_bad_checkpoint_mode() -> None:
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        make(checkpoint="sometimes")


def test_non_scalar_loss() -> None:
    with pytest.raises(ValueError, match="reduction='none'.*use reduction='mean' or 'sum'"):
        make(loss_fn=nn.MSELoss(reduction="none"))
    pipe = make(loss_fn=lambda out, y: (out - y) ** 2)
    with pytest.raises(TypeError, match="scalar tensor"):
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4))


def test_targets_batch_mismatch() -> None:
    with pytest.raises(ValueError, match="targets have batch size 3 but inputs 4"):
        make().train_step(torch.randn(4, 4), torch.randn(3, 4))


def test_cost_needing_a_sample() -> None:
    with pytest.raises(ValueError, match="needs a sample input batch"):
        make(partitions=2, cost="flops")


@pytest.mark.parametrize("kwargs,message", [
    ({"partitions": 2, "balance": [1.0, 3.0]}, r"not a whole number of layers.*balance=\[3, 2\]"),
    ({"partitions": 2, "balance": [True, 3]}, r"not a whole number of layers"),
    ({"partitions": True}, r"partitions must be an integer"),
    ({"partitions": 2, "micro_batches": True}, r"micro_batches must be an integer"),
    ({"partitions": 2, "seed": 1.7}, r"seed must be an integer"),
])
def test_numbers_that_are_not_whole_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def test_numpy_integers_are_whole_numbers() -> None:
    import numpy as np
    pipe = make(partitions=2, balance=np.array([1, 3]), seed=np.int64(5))
    assert pipe.balance == [1, 3] and all(type(n) is int for n in pipe.balance)
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 4))


@pytest.mark.parametrize("inputs,what", [
    ({"x": torch.randn(4, 4)}, "the input holds a dict"),
    ((torch.randn(4, 4), {"w": torch.randn(4)}), "the input holds a dict"),
])
def test_a_dict_in_the_batch_is_refused_saying_what_to_pass(inputs: object, what: str) -> None:
    with pytest.raises(TypeError, match=f"{what}.*pass a tuple of its values"):
        make(partitions=2).train_step(inputs, torch.randn(4, 4))
    with pytest.raises(TypeError, match="the target batch holds a dict"):
        make(partitions=2).train_step(torch.randn(4, 4), {"y": torch.randn(4, 4)})


def test_no_targets_for_a_loss_that_reads_only_the_output() -> None:
    pipe = make(partitions=2, micro_batches=2, loss_fn=lambda out, target: out.pow(2).mean())
    model = nn.Sequential(*copy.deepcopy(list(pipe.unpartitioned())))
    x = torch.randn(4, 4)
    assert pipe.train_step(x, None) == pytest.approx(float(model(x).pow(2).mean().detach()), rel=1e-5)


def test_silent_time_cut_sequence_first_layers_were_split_along_their_time_dim() -> None:
    """``nn.TransformerEncoderLayer`` with PyTorch's default ``batch_first=False`` takes (T, N, D):
    the pipeline cut its dim 0, time, into micro-batches (a loss 0.011 off full-batch training,
    inference 0.32 off), silently. Sequence-first layers are refused where the batch is cut, inside
    an nn.Sequential and a TransformerEncoder too; built batch-first, or with one micro-batch, they
    run."""
    def encoder(batch_first: bool) -> nn.Module:
        return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)

    for model in ([nn.Linear(8, 8), encoder(False), nn.Linear(8, 4)],
                  [nn.Sequential(nn.Linear(8, 8),
                                 nn.TransformerEncoder(encoder(False), 2, enable_nested_tensor=False)),
                   nn.Linear(8, 4)],
                  [nn.Linear(8, 8), nn.Sequential(nn.LSTM(8, 8)), nn.Linear(8, 4)]):
        with pytest.raises(ValueError, match=r"sequence-first \(batch_first=False.*batch_first=True"):
            make(model=model, partitions=2, micro_batches=2)
    make(model=[nn.Linear(8, 8), encoder(False), nn.Linear(8, 4)], partitions=2, micro_batches=1)
    torch.manual_seed(0)
    model = [nn.Linear(8, 8), encoder(True), nn.Linear(8, 4)]
    ref = nn.Sequential(*copy.deepcopy(model))
    x, y = torch.randn(4, 6, 8), torch.randn(4, 6, 4)
    pipe = make(model=model, partitions=2, micro_batches=2)
    loss = pipe.train_step(x, y)
    expected = nn.functional.mse_loss(ref(x), y)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_tensor_kept_on_a_module_and_read_by_a_later_layer_is_told_to_cross_as_an_output() -> None:
    """A skip connection by side channel (a layer keeps its output on an attribute, a later one reads
    it) failed in the backward with autograd's own "backward through the graph a second time"; the
    error now names the stage and micro-batch and says to pass the value through the outputs."""
    class Keep(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.kept = super().forward(x)
            return self.kept

    class ReadKept(nn.Linear):
        def __init__(self, source: Keep) -> None:
            super().__init__(4, 4)
            self.__dict__["source"] = source

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x + self.source.kept)

    keep = Keep(4, 4)
    pipe = make(model=[keep, nn.Linear(4, 4), nn.Linear(4, 4), ReadKept(keep)], partitions=2,
                micro_batches=2, checkpoint="never")
    with pytest.raises(RuntimeError, match=r"stage 1, backward of micro-batch \d.*the layers' outputs"):
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4))
