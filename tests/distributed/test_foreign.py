"""runtime="distributed": a step that reaches a layer another process holds is refused before any
update (gpipe_repro/engine/foreign.py); the local runtime trains such models as plain PyTorch does.
The references here are plain PyTorch written for the test."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.distributed import launch_local
from gpipe_repro.distributed.launcher import JobFailed


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


class _Decoder(nn.Module):
    """Uses the encoder's weight through a reference outside the module tree."""

    def __init__(self, enc: nn.Linear) -> None:
        super().__init__()
        self.__dict__["enc"] = enc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.enc.weight[:, :4]


class _Counts(nn.Module):
    """Counts its forwards in a buffer it may share with another layer."""

    def __init__(self, seen: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("seen", seen if seen is not None else torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1)
        return x


class _Cached(nn.Module):
    """Sets a buffer it shares with another layer alike at every forward (a rotary cache)."""

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("cache", cache)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.copy_(torch.arange(x.shape[-1], dtype=x.dtype))
        return x + self.cache


def _penalty_loss(model: nn.Sequential):  # noqa: ANN202 - a closure over the first weight
    w = model[0].weight
    return lambda out, y: F.cross_entropy(out, y) + 0.05 * (w ** 2).sum()


def _build(kind: str) -> tuple[nn.Sequential, object]:
    model = _mlp()
    if kind == "penalty":
        return model, _penalty_loss(model)
    if kind == "hidden":
        model[4] = _Decoder(model[0])
        return model, nn.CrossEntropyLoss()
    if kind == "counter":
        seen = torch.zeros(())
        return nn.Sequential(model[0], _Counts(seen), model[1], model[2], _Counts(seen), model[3],
                             model[4]), nn.CrossEntropyLoss()
    cache = torch.zeros(12)
    if kind == "cached-v":        # zb-v: the cache in cells 0, 1 and 2; cells 1 and 2 in one process
        return nn.Sequential(model[0], _Cached(cache), model[2], _Cached(cache), nn.Linear(12, 12),
                             _Cached(cache), model[3], model[4]), nn.CrossEntropyLoss()
    return nn.Sequential(model[0], model[1], _Cached(cache), model[2], _Cached(cache), model[3],
                         model[4]), nn.CrossEntropyLoss()


def _train(kind: str, runtime: str) -> list[torch.Tensor] | None:
    """The trained model's state (None on the ranks other than 0)."""
    from gpipe_repro.distributed import gather_layers

    model, loss_fn = _build(kind)
    x, y = _data()
    m = 1 if kind == "counter" else 2
    v = kind == "cached-v"
    balance = [2, 2, 2, 2] if v else [2, 3] if len(model) == 5 else [3, 4]   # the sharers in two cells
    pipe = GPipe(model, partitions=len(balance), balance=balance, micro_batches=4 if v else m,
                 schedule="zb-v" if v else "gpipe", checkpoint="never", runtime=runtime,
                 loss_fn=loss_fn, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    for _ in range(3):
        pipe.train_step(x, y)
    if runtime == "distributed" and not gather_layers(pipe, model):
        return None
    return [t.detach().clone() for t in model.state_dict().values()]


def _plain(kind: str) -> list[torch.Tensor]:
    model, loss_fn = _build(kind)
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(model(x), y).backward()      # type: ignore[operator]
        opt.step()
    return [t.detach().clone() for t in model.state_dict().values()]


def _distributed(kind: str) -> list[torch.Tensor] | None:
    return _train(kind, "distributed")


@pytest.mark.parametrize("kind", ["penalty", "hidden"])
def test_silent_a_loss_or_layer_reaching_another_processs_weight_trained_a_stale_copy(kind: str) -> None:
    """An L2 penalty in the loss on model[0].weight (cell 0), or a layer of cell 1 using cell 0's
    weight through a reference outside the module tree: the local runtime trains as plain PyTorch,
    the distributed one wrote the gradient into the last process's stale copy (losses off from
    the second step, the weight off by 1e-2): it now fails the first step before any update,
    naming the parameter and what to change."""
    torch.testing.assert_close(_train(kind, "local"), _plain(kind), rtol=1e-5, atol=1e-6)
    with pytest.raises(JobFailed, match=r"rank 1 failed: RuntimeError: stage 1: this step computed a "
                                        r"gradient for layer 0 \(Linear\) parameter 'weight'"):
        launch_local(_distributed, 2, kind, job_timeout=120)


def test_silent_a_buffer_shared_across_processes_counted_half_distributed() -> None:
    """A counter buffer shared by two layers in different cells (M=1, which the per-micro-batch
    check allows): plain PyTorch and the local runtime count 6 after 3 steps, the distributed runtime
    counted 3 on each process. Refused at the second step."""
    with pytest.raises(JobFailed, match="change it at every step"):
        launch_local(_distributed, 2, "counter", job_timeout=120)


@pytest.mark.parametrize("kind", ["cached", "cached-v"])
def test_a_buffer_shared_across_processes_set_alike_every_step_trains_distributed(kind: str) -> None:
    """No false refusal: a shared buffer every forward sets to the same value (a rotary cache);
    with zb-v, where one process runs two of the cells sharing it, its two stages' checks of one
    step took each other's first fill for a change at every step."""
    torch.testing.assert_close(launch_local(_distributed, 2, kind, job_timeout=120)[0],
                               _plain(kind), rtol=1e-5, atol=1e-6)


def _keeps_other_layers() -> bool:
    """Whether a process's pipeline keeps the other process's layers alive once the caller drops
    its model (it must not: a process holds its own cells only)."""
    import gc
    import os
    import weakref

    model, loss_fn = _build("penalty")
    theirs = weakref.ref(model[4].weight if os.environ["RANK"] == "0" else model[0].weight)
    pipe = GPipe(model, partitions=2, balance=[2, 3], micro_batches=2, runtime="distributed",
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    del model, loss_fn
    gc.collect()
    x, y = _data()
    pipe.train_step(x, y)
    return theirs() is not None


def test_the_check_keeps_no_other_process_layers_alive() -> None:
    """The check holds the other processes' parameters weakly: a caller that builds the whole model
    and drops it keeps one cell's memory per process, as before the check."""
    assert launch_local(_keeps_other_layers, 2, job_timeout=120) == [False, False]
