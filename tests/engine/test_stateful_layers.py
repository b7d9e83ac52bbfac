"""Layers whose forward changes their own state, and outputs that are not per example: a pipeline
runs a cell's forward once per micro-batch and again per recompute, and joins outputs along dim 0,
so either would compute something other than full-batch training and plain inference. Each is
refused, saying what to change; the references are plain PyTorch."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import spectral_norm
from torch.nn.utils.parametrizations import spectral_norm as parametrized_spectral_norm

from gpipe_repro import GPipe, is_recomputing


def _pipe(layers: Any, **kw: Any) -> GPipe:
    return GPipe(layers, loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                 **kw)


def _assert_trains_as_plain(layers: list[nn.Module], *, steps: int, **gpipe: Any) -> None:
    """`steps` pipelined SGD steps leave every parameter and buffer as plain full-batch training of a
    copy of the same layers does."""
    reference = copy.deepcopy(nn.Sequential(*layers))
    pipe = _pipe(layers, partitions=2, **gpipe)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(steps):
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        pipe.train_step(x, y)
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(reference(x), y).backward()
        optimizer.step()
    for (name, mine), theirs in zip(nn.Sequential(*layers).state_dict().items(),
                                    reference.state_dict().values()):
        torch.testing.assert_close(mine, theirs, msg=name)


class Counter(nn.Module):
    """Counts its training forwards in a buffer; skips recomputes when asked to."""

    def __init__(self, skip_recompute: bool) -> None:
        super().__init__()
        self.skip_recompute, self.lin = skip_recompute, nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not (self.skip_recompute and is_recomputing()):
            self.calls += 1
        return self.lin(x)


def test_silent_spectral_norm_power_iteration_per_micro_batch_and_recompute_is_refused() -> None:
    """spectral_norm's power iteration ran once per micro-batch and again at the recompute, from the
    vectors the forward had advanced: the backward used another sigma than the forward (parameters
    off by 2.3e-3 after two steps). Refused at construction where M > 1 or the cell recomputes."""
    for wrap, name in [(spectral_norm, r"torch.nn.utils.spectral_norm"),
                       (parametrized_spectral_norm, "parametrizations.spectral_norm")]:
        for m, mode in [(2, "never"), (1, "always")]:
            with pytest.raises(ValueError, match=rf"layer 0 \(.*Linear\) runs spectral normalization's "
                                                 rf"power iteration \({name}\).*micro_batches=1"):
                _pipe([wrap(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 3)], partitions=2,
                      micro_batches=m, checkpoint=mode)
    torch.manual_seed(0)
    _assert_trains_as_plain([spectral_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 3)], steps=2,
                            micro_batches=1, checkpoint="never")


def test_silent_layer_changing_a_buffer_in_its_forward_is_refused_at_its_first_step() -> None:
    """Any other layer that changes a buffer in its training forward (a counter here) is refused by
    the stage executor on the first forward that shows it: with M > 1, or when a recompute changes
    it (the documented way out, is_recomputing(), is accepted)."""
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    pipe = _pipe([Counter(False), nn.ReLU(), nn.Linear(4, 3)], partitions=2, micro_batches=2,
                 checkpoint="never")
    with pytest.raises(ValueError, match=r"layer 0 \(Counter\) changes its buffer 'calls' in every "
                                         "forward: with micro_batches=2"):
        pipe.train_step(x, y)
    pipe = _pipe([Counter(False), nn.ReLU(), nn.Linear(4, 3)], partitions=2, micro_batches=1,
                 checkpoint="always")
    with pytest.raises(ValueError, match=r"changed its buffer 'calls' when its forward was recomputed.*"
                                         r"is_recomputing\(\)"):
        pipe.train_step(x, y)
    for mode in ("always", "never"):
        layers = [Counter(True), nn.ReLU(), nn.Linear(4, 3)]
        pipe = _pipe(layers, partitions=2, micro_batches=1, checkpoint=mode)
        pipe.train_step(x, y)
        pipe.train_step(x, y)
        assert layers[0].calls.item() == 2           # once per step, as full-batch training


class ShapeCache(nn.Module):
    """Sets a buffer from its input's shape in every forward, as rotary embeddings do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("width", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.width.fill_(x.shape[-1])
        return self.lin(x)


def test_a_buffer_the_forward_sets_alike_each_time_is_accepted() -> None:
    """A value set from the input's shape is set once, however often the forward runs: the first
    forward changes it, the second does not, so M > 1 and recomputes give full-batch training."""
    torch.manual_seed(0)
    _assert_trains_as_plain([ShapeCache(), nn.ReLU(), nn.Linear(4, 3)], steps=1, micro_batches=4,
                            checkpoint="always")


def test_silent_pipelined_inference_of_an_output_that_is_not_per_example_is_refused() -> None:
    """pipe(x) joined a 0-dim output by returning the first micro-batch's value (-0.186 where the
    model gives -0.030) and concatenated a constant matrix M times."""
    class Mean(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mean()

    class WithConstant(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, torch.eye(3)
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"the model's output has shape \(\) on a micro-batch of 4 "
                                         "examples.*dim 0 the batch"):
        GPipe([nn.Linear(4, 4), Mean()], partitions=2, micro_batches=2).eval()(x)
    with pytest.raises(ValueError, match=r"the model's output\[1\] has shape \(3, 3\)"):
        GPipe([nn.Linear(4, 4), WithConstant()], partitions=2, micro_batches=2).eval()(x)
    layers = [nn.Linear(4, 4), Mean()]
    torch.testing.assert_close(GPipe(layers, partitions=2, micro_batches=1).eval()(x),
                               nn.Sequential(*layers)(x))


def test_lazy_parameters_are_refused_where_the_partitioner_sizes_layers() -> None:
    with pytest.raises(ValueError, match="layer 1's parameter weight is lazy.*balance="):
        _pipe([nn.Linear(4, 4), nn.LazyLinear(3)], partitions=2, micro_batches=2)
    _pipe([nn.Linear(4, 4), nn.LazyLinear(3)], partitions=2, balance=[1, 1], micro_batches=2)


@pytest.mark.parametrize("micro_batches, checkpoint", [(3, "never"), (1, "always")])
def test_silent_a_refused_step_left_the_buffer_it_refused_changed(micro_batches: int,
                                                                   checkpoint: str) -> None:
    """A layer changing its buffer in every forward is refused with M > 1 (or where a recompute runs
    its forward again), but the refusal came after the forwards that showed it: the buffer had moved
    (0.785 of a running mean that was 0), and a user following the advice (micro_batches=1) started
    from it. A refused step now puts the buffers back as the step found them."""

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), Counter(skip_recompute=False), nn.Tanh(), nn.Linear(4, 4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = GPipe(model, partitions=2, balance=[2, 2], micro_batches=micro_batches, checkpoint=checkpoint,
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ValueError, match="buffer 'calls'"):
        pipe.train_step(torch.randn(12, 8), torch.randint(0, 4, (12,)))
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
