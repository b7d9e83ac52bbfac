"""GPipe(compile=...): each layer runs under torch.compile, and training equals plain training.

The tests compile with ``backend="aot_eager"`` (Dynamo's graph capture and AOTAutograd's joint graph,
run by eager kernels): the whole path GPipe owns (capture per layer, recompute, in-place guard,
every checkpoint mode and schedule) at a fraction of inductor's compile time, which on this CPU host
is about 15 s per small layer. Its kernels are eager's, so the results equal eager plain training
within floating-point tolerance.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe
from tests.equivalence import assert_same_training

AOT = {"backend": "aot_eager"}


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Dropout(0.2), nn.BatchNorm1d(8),
            nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


@pytest.mark.parametrize(("checkpoint", "schedule"), [("always", "gpipe"), ("except_last", "1f1b"),
                                                      ("never", "interleaved")])
def test_compiled_layers_train_like_plain_training(checkpoint: str, schedule: str) -> None:
    """Every checkpoint mode (a checkpointed forward under no_grad, then its recompute), dropout
    masks drawn as eager's, BatchNorm deferred, an in-place layer right after a cut (balance puts the
    ReLU first in cell 1)."""
    x, y = batch()
    pipe = assert_same_training(layers(), x, y, nn.CrossEntropyLoss(), partitions=4, micro_batches=4,
                                checkpoint=checkpoint, schedule=schedule, balance=[1, 2, 2, 2],
                                steps=2, compile=AOT, clip_grad_norm=1.0)
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["total"] > 0 and frames["ok"] == frames["total"], \
        f"a layer fell back to eager (recompile limit, or a frame Dynamo could not convert): {frames}"
    assert pipe.executors[1].input_guard.learned[(True, 0)], "the in-place ReLU after the cut is seen"
    pipe.eval()
    eager = GPipe(copy.deepcopy(list(pipe.unpartitioned())), partitions=2, micro_batches=2,
                  optimizer=None).eval()
    torch.testing.assert_close(pipe(x), eager(x))


def test_compile_leaves_the_model_and_its_state_dict_as_they_are() -> None:
    plain = GPipe(layers(), partitions=2, micro_batches=2, optimizer=None)
    compiled = GPipe(layers(), partitions=2, micro_batches=2, optimizer=None, compile=AOT)
    assert list(compiled.state_dict()) == list(plain.state_dict())
    assert all(type(layer).__module__.startswith("torch.nn") or "batchnorm" in type(layer).__module__
               for layer in compiled.unpartitioned())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"compile": "reduce-overhead"}, "records CUDA graphs"),
    ({"compile": {"options": {"triton.cudagraphs": True}}}, "records CUDA graphs"),
    ({"compile": AOT, "schedule": "zb-h1"}, "zero-bubble split cannot defer"),
    ({"compile": AOT, "schedule": "zb-v", "partitions": 4}, "schedule='zb-v'"),
    ({"compile": {"backnd": "eager"}}, r"\['backnd'\] are not torch.compile arguments"),
    ({"compile": 3}, "compile must be True, False"),
    ({"compile": {"backend": "cudagraphs"}}, "records CUDA graphs"),
    ({"compile": "turbo"}, "'turbo' is not a torch.compile mode; use one of default, lite, "
                           "max-autotune-no-cudagraphs"),
    ({"compile": ""}, "'' is not a torch.compile mode"),
    ({"compile": {"backend": "no_such_backend"}}, "'no_such_backend' is not a torch.compile backend"),
    ({"compile": {"backend": 3}}, "a backend is a name or a callable"),
    ({"compile": {"mode": "default", "options": {"trace.enabled": False}}}, "a mode or options, not both"),
])
def test_combinations_compile_cannot_serve_are_refused_before_any_work(kwargs: dict, message: str) -> None:
    built: list[int] = []

    class Counted(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            built.append(1)
            return super().forward(x)
    options = {"partitions": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        GPipe([Counted(4, 4) for _ in range(4)], micro_batches=2, optimizer=None, **options)
    assert not built


class StartsInPlaceLater(nn.Module):
    """``x * 2`` until `in_place` is set, then ``x.mul_(2)`` on the input it was fed."""

    def __init__(self) -> None:
        super().__init__()
        self.in_place = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2) if self.in_place else x * 2


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_compiled_layer_that_starts_working_in_place_is_caught_then_copied(checkpoint: str) -> None:
    """Under compile, a cell re-materialized after its no-grad forward met autograd's "view created
    in no_grad mode ... modified inplace" (wrapped by Dynamo) instead of the guard's own check: every
    later step failed with Dynamo's error. Now, as in eager mode: that step fails before any update,
    the cell's input is copied from then on, and the next step trains as plain PyTorch does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), StartsInPlaceLater(), nn.Linear(8, 3))
    pipe = GPipe(model, partitions=3, micro_batches=2, checkpoint=checkpoint, balance=[1, 1, 2],
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                 compile=AOT)
    x, y = batch()
    pipe.train_step(x, y)
    model[2].in_place = True
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="modified its input in place .* no cell was updated"):
        pipe.train_step(x, y)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    reference = copy.deepcopy(model)
    reference[2].in_place = False        # plain training of the same function: x * 2
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.cross_entropy(reference(x), y).backward()
    opt.step()
    pipe.train_step(x, y)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, msg=name)


def test_silent_frozen_copy_a_deep_copy_of_a_compiled_pipeline_ran_the_originals_layers() -> None:
    """``best = copy.deepcopy(pipe)`` with compile: each compiled runner closed over the original's
    layer, so the copy's output followed the original's later training, and training the copy moved
    none of its own weights (and left gradients on the original's), silently. A copy, and a pipeline
    loaded by ``torch.load``, compile their own layers; the reference is the plain copy."""
    import io
    x, y = batch()
    pipe = GPipe(layers(), partitions=2, micro_batches=2, loss_fn=nn.CrossEntropyLoss(), compile=AOT,
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    pipe.train_step(x, y)
    best = copy.deepcopy(pipe)
    plain = nn.Sequential(*copy.deepcopy(pipe.unpartitioned())).eval()
    pipe.train_step(x, y)
    best.eval()
    torch.testing.assert_close(best(x), plain(x))
    before = [p.detach().clone() for p in best.parameters()]
    best.train()
    best.train_step(x, y)
    assert all(not torch.equal(p, q) for p, q in zip(best.parameters(), before) if p.dim() > 1)
    buffer = io.BytesIO()
    torch.save(pipe, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False).eval()
    pipe.eval()
    torch.testing.assert_close(loaded(x), pipe(x))


def test_fullgraph_with_batchnorm_is_refused_before_any_work() -> None:
    """compile={"fullgraph": True} with a BatchNorm failed inside Dynamo at the first step (the
    statistics are recorded outside the graph): refused when built, saying what to pass."""
    with pytest.raises(ValueError, match="drop fullgraph, or pass deferred_batchnorm=False"):
        GPipe(layers(), partitions=2, micro_batches=2, optimizer=None, compile={**AOT, "fullgraph": True})
    GPipe(layers(), partitions=2, micro_batches=2, optimizer=None, compile={**AOT, "fullgraph": True},
          deferred_batchnorm=False)
