"""Losses whose mean is not a per-row mean (cross-entropy with ignored targets or class weights)
train exactly like full-batch training. The reference is plain PyTorch on the whole mini-batch
(no engine code, no micro-batches): its loss divides by what PyTorch's own mean divides by."""
from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5))


class TokenHead(nn.Module):
    """(N, 6) -> (N, 5, 3): a class score per class and position (K-dimensional cross-entropy)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 15)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).view(-1, 5, 3)


def _plain(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Any) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _trains_as_plain(layers: list[nn.Module], x: Any, y: Any, loss_fn: Any, micro_batches: int,
                     **gpipe: Any) -> None:
    """One step of `layers` through GPipe (K=2) equals plain PyTorch's: the loss and every parameter."""
    ref = nn.Sequential(*copy.deepcopy(layers))
    expected = _plain(ref, [(x, y)], loss_fn)
    pipe = GPipe(copy.deepcopy(layers), partitions=2, micro_batches=micro_batches, loss_fn=loss_fn,
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9), **gpipe)
    assert pipe.train_step(x, y) == pytest.approx(expected[0], rel=1e-5)
    for p, q in zip(pipe.unpartitioned().parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def _batches(token: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        x = torch.randn(11, 6, generator=g)
        y = torch.randint(0, 5, (11, 3) if token else (11,), generator=g)
        # padding, unevenly spread over the micro-batches (rows 0-3 are the first of three)
        if token:
            y[:3, 1:] = -100
            y[9, 0] = -100
        else:
            y[[0, 1, 2, 8]] = -100
        out.append((x, y))
    return out


LOSSES = {
    "ce ignore_index": (lambda: nn.CrossEntropyLoss(), False),
    "ce weight + label smoothing": (lambda: nn.CrossEntropyLoss(weight=torch.tensor(
        [0.2, 1.0, 3.0, 0.5, 1.5]), label_smoothing=0.1), False),
    "ce token-level weight": (lambda: nn.CrossEntropyLoss(weight=torch.tensor(
        [0.2, 1.0, 3.0, 0.5, 1.5])), True),
    "nll weight": (lambda: nn.Sequential(nn.LogSoftmax(1), _Nll()), False),
}


class _Nll(nn.NLLLoss):
    def __init__(self) -> None:
        super().__init__(weight=torch.tensor([1.0, 2.0, 0.3, 1.0, 4.0]))


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("schedule,checkpoint", [("gpipe", "except_last"), ("1f1b", "never"),
                                                 ("zb-h1", "always")])
def test_cross_entropy_with_padding_and_weights_equals_full_batch(name: str, schedule: str,
                                                                  checkpoint: str) -> None:
    make_loss, token = LOSSES[name]
    layers = list(_model()) + ([TokenHead()] if token else [])
    loss_fn = make_loss()
    if isinstance(loss_fn, nn.Sequential):         # log-softmax in the model, NLL as the loss
        layers.append(loss_fn[0])
        loss_fn = loss_fn[1]
    batches = _batches(token)
    ref = nn.Sequential(*copy.deepcopy(layers))
    ref_losses = _plain(ref, batches, loss_fn)
    pipe = GPipe(copy.deepcopy(layers), partitions=2, micro_batches=3, checkpoint=checkpoint,
                 schedule=schedule, loss_fn=loss_fn,
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9))
    losses = [pipe.train_step(x, y) for x, y in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for (name_, p), q in zip(pipe.unpartitioned().named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name_)


def test_a_loss_with_trainable_parameters_is_refused() -> None:
    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.temperature = nn.Parameter(torch.ones(()))

        def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(out / self.temperature, y)
    with pytest.raises(ValueError, match="loss_fn has trainable parameters.*temperature.*last layer"):
        GPipe(list(_model()), partitions=2, micro_batches=2, loss_fn=Tempered())


def test_a_cross_entropy_subclass_with_its_own_forward_is_the_users_loss() -> None:
    """Only the stock forward is run as summed losses over the denominator: a focal loss (or any
    subclass computing something else) trains on what it computes, as plain PyTorch does."""
    class Focal(nn.CrossEntropyLoss):
        def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logp = torch.log_softmax(out, 1).gather(1, y[:, None]).squeeze(1)
            return (-(1 - logp.exp()) ** 2 * logp).mean()
    _trains_as_plain(list(_model()), torch.randn(12, 6), torch.randint(0, 5, (12,)), Focal(), 3)


def test_a_mini_batch_whose_every_target_is_ignored_has_a_nan_loss_as_pytorchs() -> None:
    """Cross-entropy's mean over no counted target is 0/0 in PyTorch: the engine's weight 1/0 must
    be NaN too, not inf (or 0, which would train on nothing silently)."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 5), torch.full((4,), -100)
    assert torch.isnan(nn.functional.cross_entropy(torch.randn(4, 3), y))
    pipe = GPipe([nn.Linear(5, 3)], micro_batches=2, loss_fn=nn.CrossEntropyLoss(),
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert math.isnan(pipe.train_step(x, y))


def _sgd(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.5, momentum=0.9)


def test_silent_half_loss_a_summing_function_was_combined_as_a_mean() -> None:
    """A function declares no reduction, so the engine combined its micro-batch losses as means: a
    summing function trained on 1/M of its loss (half at M=2). Its first micro-batch now tells: a
    sum is refused, saying to pass loss_reduction='sum', which then equals plain training."""
    def summed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y, reduction="sum")
    layers = list(_model())
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
    pipe = GPipe(copy.deepcopy(layers), partitions=2, micro_batches=2, loss_fn=summed, optimizer=_sgd)
    before = [p.detach().clone() for p in pipe.parameters()]
    with pytest.raises(ValueError, match="sums over its rows.*loss_reduction='sum'"):
        pipe.train_step(x, y)
    assert all(torch.equal(p, q) for p, q in zip(pipe.parameters(), before))   # nothing changed
    ref = nn.Sequential(*copy.deepcopy(layers))
    expected = _plain(ref, [(x, y)], summed)
    pipe = GPipe(copy.deepcopy(layers), partitions=2, micro_batches=2, loss_fn=summed,
                 loss_reduction="sum", optimizer=_sgd)
    assert pipe.train_step(x, y) == pytest.approx(expected[0], rel=1e-5)
    for p, q in zip(pipe.unpartitioned().parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_silent_row_weighting_a_function_token_mean_with_ignored_targets() -> None:
    """F.cross_entropy's mean counts the targets other than -100; as a function it declares nothing,
    and the engine weighed each micro-batch by its rows (0.9346 against 0.9863 with the padding in one
    micro-batch). Such targets are now refused before any work, naming the losses that are exact."""
    def token_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)
    x, y = _batches(token=False)[0]
    pipe = GPipe(list(_model()), partitions=2, micro_batches=3, loss_fn=token_mean, optimizer=_sgd)
    with pytest.raises(ValueError, match="targets hold -100.*nn.CrossEntropyLoss"):
        pipe.train_step(x, y)
    assert pipe.step == 0
    # declared, the caller owns the weighting; the stock loss is exact (tested above)
    GPipe(list(_model()), partitions=2, micro_batches=3, loss_fn=token_mean, loss_reduction="mean",
          optimizer=_sgd).train_step(x, y)


def test_a_mean_function_trains_as_plain_pytorch_and_a_batch_coupled_loss_is_refused() -> None:
    def mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)
    layers = list(_model())
    x, y = torch.randn(9, 6), torch.randint(0, 5, (9,))
    ref = nn.Sequential(*copy.deepcopy(layers))
    expected = _plain(ref, [(x, y)], mean)
    pipe = GPipe(copy.deepcopy(layers), partitions=3, micro_batches=3, loss_fn=mean, optimizer=_sgd)
    assert pipe.train_step(x, y) == pytest.approx(expected[0], rel=1e-5)
    for p, q in zip(pipe.unpartitioned().parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)

    def batch_logsumexp(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:   # couples the rows
        return torch.logsumexp(out[:, 0], 0)
    pipe = GPipe(copy.deepcopy(layers), partitions=2, micro_batches=3, loss_fn=batch_logsumexp,
                 optimizer=_sgd)
    with pytest.raises(ValueError, match="not a mean over its rows"):
        pipe.train_step(x, y)


def test_silent_weighting_functions_that_are_no_per_row_mean_passed_the_first_check() -> None:
    """A second review found losses the row-repeating probe let through, each training on another
    function: class weights in F.cross_entropy (1.5817 vs 1.5791), padding marked 0 (a micro-batch all
    padding gave NaN), a mean over a float mask (1.155 vs 1.069), and sums it skipped (a tuple
    output: 6.41 vs 25.6; a first row of loss 0). Each micro-batch of the first step is now cut in
    two rows, alone and together, whose losses a per-row mean averages."""
    F = nn.functional
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 6, generator=g), torch.randint(1, 5, (8,), generator=g)
    weights = torch.tensor([0.2, 1.0, 3.0, 0.5, 1.5])
    padded = y.clone()
    padded[:2] = 0                                   # the first micro-batch (of 4) all padding
    mask = torch.tensor([1, 1, 1, 0, 1, 0, 1, 1])
    first_zero = torch.randn(8, 5, generator=g)

    class Pair(nn.Module):
        def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return h, h * 2

    cases: list[tuple[Any, Any, list[nn.Module], str]] = [
        (lambda o, t: F.cross_entropy(o, t, weight=weights), y, [], "not a mean over its rows"),
        (lambda o, t: F.cross_entropy(o, t, ignore_index=0), padded, [], "NaN on a micro-batch"),
        (lambda o, t: (F.cross_entropy(o, t, reduction="none") * t.float()).sum() / t.float().sum(),
         mask, [], "not a mean over its rows|NaN on one row"),
        (lambda o, t: F.cross_entropy(o[0] + o[1], t, reduction="sum"), y, [Pair()], "sums over its rows"),
        (lambda o, t: ((o - t) ** 2).sum(), first_zero, [], "sums over its rows"),
    ]
    first_zero[0] = 0.0
    for loss_fn, target, extra, says in cases:
        layers = [*_model(), *extra]
        if target is first_zero:             # a first row whose loss is 0
            target = target.clone()
            with torch.no_grad():
                target[0] = nn.Sequential(*_model())(x[:1])[0]
        pipe = GPipe(layers, partitions=2, micro_batches=4 if target is not mask else 2,
                     loss_fn=loss_fn, optimizer=_sgd)
        before = [p.detach().clone() for p in pipe.parameters()]
        with pytest.raises(ValueError, match=says):
            pipe.train_step(x, target)
        assert all(torch.equal(p, q) for p, q in zip(pipe.parameters(), before)) and pipe.step == 0


def test_one_micro_batch_takes_any_loss_as_plain_training() -> None:
    """At M=1 on one replica the micro-batch is the whole batch, so any loss is plain training's:
    a function ignoring a class (the first row's target, so its probe of single rows read NaN) was
    refused all the same; it now trains equal to the plain model. At M=2 it is still refused."""
    def ignore_background(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y, ignore_index=0)
    layers = list(_model())
    x, y = torch.randn(8, 6), torch.tensor([0, 1, 2, 3, 1, 2, 3, 0])
    ref = nn.Sequential(*copy.deepcopy(layers))
    expected = _plain(ref, [(x, y), (x, y)], ignore_background)
    pipe = GPipe(copy.deepcopy(layers), partitions=2, micro_batches=1, loss_fn=ignore_background,
                 optimizer=_sgd)
    got = [pipe.train_step(x, y) for _ in range(2)]
    assert got == pytest.approx(expected, rel=1e-6)
    for p, q in zip(pipe.unpartitioned().parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    pipe = GPipe(copy.deepcopy(layers), partitions=2, micro_batches=2, loss_fn=ignore_background,
                 optimizer=_sgd)
    with pytest.raises(ValueError):
        pipe.train_step(x, y)


def test_silent_row_weighting_a_cross_entropy_subclass_that_only_logs_kept_its_declared_mean() -> None:
    """A subclass of nn.CrossEntropyLoss with a forward of its own (here one that logs and calls the
    stock forward) declares reduction='mean', which the engine took at its word: with class weights
    and padding its micro-batches were weighted by rows, not by the weight of their counted targets
    (0.2 off in the gradients at K=2, M=2, no error). A reduction declared by a user's forward is now
    checked like an undeclared one; a subclass whose mean is a per-row mean trains as plain PyTorch."""
    seen: list[float] = []

    class LoggedCE(nn.CrossEntropyLoss):
        def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = super().forward(out, y)
            seen.append(float(loss.detach()))
            return loss
    x, y = _batches(False)[0]
    y = y.clamp(min=0)              # no ignored target: the class weights alone break the row mean
    weighted = LoggedCE(weight=torch.tensor([0.2, 1.0, 3.0, 0.5, 1.5]))
    pipe = GPipe(list(_model()), partitions=2, micro_batches=2, loss_fn=weighted,
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    before = [p.detach().clone() for p in pipe.parameters()]
    with pytest.raises(ValueError, match=r"loss_fn \(LoggedCE\) declares reduction='mean' and has a "
                                         r"forward of its own.*not a mean over its rows"):
        pipe.train_step(x, y)
    assert all(torch.equal(b, p) for b, p in zip(before, pipe.parameters()))   # nothing changed
    with pytest.raises(ValueError, match=r"\(LoggedCE\) declares reduction='mean'.*hold -100"):
        GPipe(list(_model()), partitions=2, micro_batches=2, loss_fn=LoggedCE(),
              optimizer=None).train_step(*_batches(False)[0])
    # unweighted, no padding: a per-row mean, equal to plain training; loss_reduction accepts as given
    _trains_as_plain(list(_model()), x, y, LoggedCE(), 2)
    GPipe(list(_model()), partitions=2, micro_batches=2, loss_fn=weighted, loss_reduction="mean",
          optimizer=_sgd).train_step(x, y)


def test_silent_masked_mean_with_the_mask_in_a_tuple_of_targets_was_not_checked() -> None:
    """A function's mean over a mask passed as targets (y, mask) skipped the per-row-mean check that
    the same loss on one stacked tensor fails (the probe cut only tensor targets): trained 0.4% off
    the full batch, no error. The targets' tensors are now cut by rows as the micro-batches are."""
    def masked_mse(out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        y, mask = target
        return (((out - y) ** 2).mean(1) * mask).sum() / mask.sum()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 5, generator=g)
    mask = torch.tensor([1.0, 1, 0, 0, 1, 1, 1, 0])
    pipe = GPipe(list(_model()), partitions=2, micro_batches=2, loss_fn=masked_mse, optimizer=None)
    with pytest.raises(ValueError, match="loss_fn declares no reduction and .*not a per-row mean"):
        pipe.train_step(x, (y, mask))
    # a tuple whose loss is a per-row mean trains as plain PyTorch
    def row_mean(out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (((out - target[0]) ** 2).mean(1) * target[1]).mean()
    _trains_as_plain(list(_model()), x, (y, mask), row_mean, 2)


def test_silent_no_update_an_optimizer_factory_that_returned_none() -> None:
    """A factory that forgot its `return` gave every cell optimizer None, which reads as "no
    optimizer": train_step ran and nothing ever updated. Refused at construction, as is an optimizer
    built over parameters that are not its cell's (every cell's would update them)."""
    def forgot(params: list[nn.Parameter]) -> None:
        torch.optim.SGD(params, lr=0.1)
    with pytest.raises(ValueError, match="optimizer returned None for cell 0.*needs its return"):
        GPipe(list(_model()), partitions=2, micro_batches=2, loss_fn=nn.MSELoss(),
              optimizer=forgot)  # type: ignore[arg-type]
    model = _model()
    with pytest.raises(ValueError, match="optimizer built for cell 0 holds 4 parameter.*not that cell's"):
        GPipe(list(model), partitions=2, micro_batches=2, loss_fn=nn.MSELoss(), balance=[2, 3],
              optimizer=lambda ps: torch.optim.SGD(model.parameters(), lr=0.1))
    # a subset of the cell's parameters (frozen ones left out) is an optimizer of that cell
    GPipe(list(_model()), partitions=2, micro_batches=2, loss_fn=nn.MSELoss(),
          optimizer=lambda ps: torch.optim.SGD(list(ps)[:1], lr=0.1))


def test_silent_a_refused_loss_trained_when_the_step_was_run_again() -> None:
    """The first-step check counted its calls before it refused, so a step run again after the
    refusal (a notebook cell re-run, a loop that catches and retries) used up the check: the fifth
    try trained on the row-weighted mean of a class-weighted loss. A call counts once it passed."""
    class WeightedCE(nn.CrossEntropyLoss):
        def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return super().forward(out, y)
    x, y = _batches(False)[0]
    pipe = GPipe(list(_model()), partitions=2, micro_batches=2, optimizer=_sgd,
                 loss_fn=WeightedCE(weight=torch.tensor([0.2, 1.0, 3.0, 0.5, 1.5])))
    before = [p.detach().clone() for p in pipe.parameters()]
    for _ in range(6):
        with pytest.raises(ValueError, match="not a mean over its rows"):
            pipe.train_step(x, y.clamp(min=0))
    assert all(torch.equal(b, p) for b, p in zip(before, pipe.parameters())) and pipe.step == 0


def test_a_time_first_output_whose_length_equals_the_rows_was_refused_as_no_row_mean() -> None:
    """A time-first model (nn.LSTM's default layout: output (T, n, V)) whose sequence length equals a
    micro-batch's rows had its time steps cut as rows by the probe, and its per-row mean was refused
    (at T = n only). The two rows are also taken the other way round: where the loss changes, dim 0
    is not the rows, and the probe says nothing."""
    class TimeFirst(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return ids.t().unsqueeze(-1).float().expand(-1, -1, 5) * torch.linspace(0.1, 0.5, 5)

    class Head(nn.Linear):
        pass

    class TimeFirstCE(nn.CrossEntropyLoss):
        def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return super().forward(out.reshape(-1, out.shape[-1]), y.t().reshape(-1))
    g = torch.Generator().manual_seed(5)
    ids, y = torch.randint(0, 5, (8, 4), generator=g), torch.randint(0, 5, (8, 4), generator=g)
    layers = [TimeFirst(), Head(5, 5), nn.Tanh(), Head(5, 5)]   # T = 4 = rows of each micro-batch
    _trains_as_plain(layers, ids, y, TimeFirstCE(), 2)


def test_a_loss_that_contradicts_its_declared_reduction_is_told_which_to_declare() -> None:
    """A module declaring reduction='mean' whose forward sums was told "neither the mean nor the sum"
    (it was the sum) and to pass loss_reduction='sum', which the declared 'mean' refuses."""
    class SaysMean(nn.MSELoss):
        def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((out - y) ** 2).sum()
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 5, generator=g)
    pipe = GPipe(list(_model()), partitions=2, micro_batches=2, loss_fn=SaysMean(), optimizer=_sgd)
    with pytest.raises(ValueError, match="declares reduction='mean'.*but it computes a sum over its "
                                         "rows.*set its reduction to 'sum'"):
        pipe.train_step(x, y)


def test_an_optimizer_whose_step_needs_a_closure_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="LBFGS.step needs a closure"):
        GPipe(list(_model()), partitions=2, micro_batches=2, loss_fn=nn.MSELoss(),
              optimizer=lambda ps: torch.optim.LBFGS(ps))


def test_silent_a_summing_loss_went_unchecked_when_micro_batches_were_raised_after_construction() -> None:
    """Built with M=1 (any loss is then plain training's), the check was never installed: set to
    M=4 afterwards (``pipe.micro_batches = 4``), a summing function trained on a quarter of its loss
    (4.55 for 18.18). The check now starts at the first step that splits the mini-batch."""
    def summed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y, reduction="sum")
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
    pipe = GPipe(list(_model()), partitions=2, micro_batches=1, loss_fn=summed, optimizer=_sgd)
    pipe.train_step(x, y)                     # M=1: exact, not refused
    pipe.micro_batches = 4
    with pytest.raises(ValueError, match="sums over its rows.*loss_reduction='sum'"):
        pipe.train_step(x, y)


def test_silent_a_median_over_rows_passed_as_a_mean() -> None:
    """The median of two rows' losses is their mean, so the two-row probe let a median loss through
    (loss 1.749 for the full batch's 1.795, gradients off by 70%). Three rows tell."""
    def median(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.quantile(nn.functional.cross_entropy(out, y, reduction="none"), 0.5)
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
    pipe = GPipe(list(_model()), partitions=2, micro_batches=2, loss_fn=median, optimizer=_sgd)
    with pytest.raises(ValueError, match="not a mean over its rows: 3 rows"):
        pipe.train_step(x, y)


def test_silent_a_small_load_balancing_term_passed_within_float32_rounding() -> None:
    """A Switch-style load-balancing term (a statistic of the batch's rows) at 0.001 changed the
    loss of three rows by less than float32's tolerance, and the router's gradient trained 1.5% off.
    The probe computes in float64 where the loss does, and sees it; the same loss without the term
    still trains."""
    def balanced(coefficient: float) -> Any:
        def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            share = out.softmax(-1).mean(0)
            return nn.functional.cross_entropy(out, y) + coefficient * out.shape[-1] * (share * share).sum()
        return loss
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
    pipe = GPipe(list(_model()), partitions=2, micro_batches=2, loss_fn=balanced(1e-3), optimizer=_sgd)
    with pytest.raises(ValueError, match="not a mean over its rows"):
        pipe.train_step(x, y)
    layers = list(_model())
    ref = nn.Sequential(*copy.deepcopy(layers))
    expected = _plain(ref, [(x, y)], balanced(0.0))
    pipe = GPipe(layers, partitions=2, micro_batches=2, loss_fn=balanced(0.0), optimizer=_sgd)
    assert pipe.train_step(x, y) == pytest.approx(expected[0], rel=1e-6)


def test_a_loss_that_overflowed_was_refused_as_a_mean_over_padding() -> None:
    """A hand-written -log(softmax) that overflows to inf on finite outputs was refused as "a mean
    over the targets that count, where those rows have none (all padding)": no target was padding.
    An infinite loss is the loss's own overflow, which plain training meets alike: the step returns
    it (a NaN loss of finite outputs, 0 / 0, is still refused as a mean over no counted target)."""
    def overflowing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return -torch.log(torch.softmax(out * 1e4, -1).gather(1, target[:, None])).mean()

    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
    pipe = GPipe(_model(), partitions=2, micro_batches=2, loss_fn=overflowing, optimizer=None)
    assert pipe.train_step(x, y) == float("inf")


def test_silent_loss_over_accuracy_a_loss_and_a_metric_were_read_as_sum_and_count() -> None:
    """``loss_fn`` returning ``(cross_entropy, accuracy)`` to log a metric trained on the loss divided
    by the accuracy (2.577 against 1.289 at K=2, M=1; every gradient off), silently: a pair is
    ``(sum, count)``. Both must add up over rows, checked on the first calls; a count that requires
    grad is refused on every call. A true ``(sum, count)`` still trains as plain PyTorch's token mean."""
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))

    def with_accuracy(out: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.cross_entropy(out, t), (out.argmax(-1) == t).float().mean()

    for m in (1, 2):
        pipe = GPipe(_model(), partitions=2, micro_batches=m, loss_fn=with_accuracy, optimizer=None)
        with pytest.raises(ValueError, match="does not add up over rows"):
            pipe.train_step(x, y)

    def counted_rows(out: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.cross_entropy(out, t, reduction="sum"), (out.argmax(-1) == t).float().mean()

    pipe = GPipe(_model(), partitions=2, micro_batches=2, loss_fn=counted_rows, optimizer=None)
    with pytest.raises(ValueError, match="Its count does not add up"):
        pipe.train_step(x, y)

    def differentiable_count(out: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.cross_entropy(out, t, reduction="sum"), out.softmax(-1).max(-1).values.sum()

    pipe = GPipe(_model(), partitions=2, micro_batches=2, loss_fn=differentiable_count, optimizer=None)
    with pytest.raises(TypeError, match="count requires grad"):
        pipe.train_step(x, y)

    def summed(out: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        return nn.functional.cross_entropy(out, t, reduction="sum"), t.shape[0]

    layers = list(_model())
    ref = nn.Sequential(*copy.deepcopy(layers))
    expected = _plain(ref, [(x, y)], nn.CrossEntropyLoss())
    pipe = GPipe(layers, partitions=2, micro_batches=3, loss_fn=summed, optimizer=_sgd)
    assert pipe.train_step(x, y) == pytest.approx(expected[0], rel=1e-6)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_silent_weighting_a_masked_mean_over_rows_sorted_by_length_passed_the_row_probe() -> None:
    """A masked mean (``(err * mask).sum() / mask.sum()``) over a batch sorted by length: each
    micro-batch's rows are equally masked, so three rows of one micro-batch agree, and the step
    trained a loss 0.76 against 0.90, silently. The probe also takes the first row of each
    micro-batch with the first micro-batch's."""
    x, tgt = torch.randn(10, 6), torch.randn(10, 5)
    mask = torch.zeros(10, 5)
    mask[:5] = 1
    mask[5:, 0] = 1            # rows 0-4: 5 positions count, rows 5-9: 1

    def masked_mean(out: torch.Tensor, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return ((out - t[0]) ** 2 * t[1]).sum() / t[1].sum()

    pipe = GPipe(_model(), partitions=2, micro_batches=2, loss_fn=masked_mean, optimizer=None)
    with pytest.raises(ValueError, match="not a mean over its rows"):
        pipe.train_step(x, (tgt, mask))
    layers = list(_model())     # a per-row mean over rows of unequal lengths still trains
    ref = nn.Sequential(*copy.deepcopy(layers))
    mse = nn.functional.mse_loss
    expected = _plain(ref, [(x, tgt)], mse)
    pipe = GPipe(layers, partitions=2, micro_batches=2, loss_fn=lambda o, t: mse(o, t), optimizer=_sgd)
    assert pipe.train_step(x, tgt) == pytest.approx(expected[0], rel=1e-6)
