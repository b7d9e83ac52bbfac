"""The last stage's loss: each micro-batch's loss weighted for the backward, and losses whose mean is
not a per-row mean made exact under micro-batching.

:func:`weighted_loss` is what the last stage computes per micro-batch: ``loss_fn(output, targets)``,
a 0-dim tensor or ``(sum, count)``, checked, upcast to float32 (:func:`~.precision.upcast`) and
multiplied by the micro-batch's weight (n_m / N for a mean loss, 1 for a sum or a ``(sum, count)``
loss, whose counts the stages agree on at AGREE).

The pipeline combines micro-batch losses with weights n_m / N (a ``reduction="mean"`` loss) or 1
(``"sum"``), which is the full-batch loss when the loss averages over rows. ``nn.CrossEntropyLoss``
and ``nn.NLLLoss`` with class-index targets do not: their mean divides by the summed weight of the
targets that count, ``sum_i w[y_i]`` over targets other than ``ignore_index`` (PyTorch's
documentation of both losses, "reduction='mean'"), so a micro-batch with more padding, or with
rarer classes, weighs differently than its share of rows.

:func:`exact_mean` splits such a loss into what each micro-batch computes, its summed loss (the same
loss with ``reduction="sum"``), and the mini-batch's denominator (:func:`denominator`, summed over
every micro-batch before the step: every rank holds the whole mini-batch). Each micro-batch's sum is
then weighted by 1 / that denominator, so the step's loss and gradients are the full batch's,
padding and class weights included, and the gradients flowing back have the mean's magnitude (a sum
form would scale them by the batch, which fp16's loss scale would pay for). A mini-batch whose every
target is ignored has a NaN loss, as PyTorch's.

A loss that declares no reduction (a function, or a module without ``.reduction``) and returns a
0-dim tensor is combined as a mean over rows unless the caller says otherwise (``loss_reduction=``).
That assumption is checked during the first step (:class:`ReductionCheck`), because
when it is wrong the step silently differs from full-batch training: a summing function would train
on half the loss at M=2, and a function's mean over the targets that count (``F.cross_entropy`` with
padding marked -100) weighs a micro-batch by its rows, not by its tokens. So is the reduction a
module declares with a ``forward`` of its own (:func:`own_forward`: a subclass of
``nn.CrossEntropyLoss`` that logs, a focal loss): its ``.reduction`` is a claim its code may not
keep, and a class-weighted cross-entropy's mean, made exact for the stock module, is then the
user's computation.
"""
from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.boundary import tensors
from gpipe_repro.engine.precision import upcast
from gpipe_repro.engine.traced import has_values

__all__ = ["exact_mean", "denominator", "weighted_loss", "loss_weights", "ReductionCheck", "CountedCheck",
           "own_forward", "refuse_ignored_targets", "IGNORED_TARGET"]

IGNORED_TARGET = -100
"""The class index ``F.cross_entropy`` and ``F.nll_loss`` ignore by default (and transformers' labels
use for padding)."""

_MeanLoss = nn.CrossEntropyLoss | nn.NLLLoss


def denominator(loss: _MeanLoss, target: torch.Tensor) -> torch.Tensor:
    """What `loss`'s ``reduction="mean"`` divides by for `target`, as a 0-dim float64 tensor (no host
    read): the summed class weight of the targets other than ``ignore_index`` (their count without
    ``weight``); for class probabilities (floating targets, N x C x ...), the number of positions
    N x ...."""
    if target.is_floating_point():
        return _number(target.numel() // target.shape[1] if target.dim() > 1 else 1, target)
    if not has_values(target):
        return _number(target.numel(), target)   # shapes only (the memory planner's trace)
    kept = target != loss.ignore_index
    if loss.weight is None:
        return kept.sum(dtype=torch.float64)   # a count: exact in float64
    return loss.weight.to(target.device)[target.masked_select(kept)].sum().double()


def _number(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float(n), dtype=torch.float64, device=like.device)


def exact_mean(loss_fn: Any) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor] | None]:
    """`loss_fn` as the stages should call it, and the denominator function of the mini-batch's
    targets: ``(the loss with reduction="sum", denominator)`` for a ``reduction="mean"``
    ``nn.CrossEntropyLoss`` or ``nn.NLLLoss`` (see the module docstring); ``(loss_fn, None)`` for
    anything else: a subclass with its own ``forward`` (a focal loss, an added term) is the user's
    computation and runs as given, weighted n_m / N as any mean loss once :class:`ReductionCheck`
    found it a per-row mean; so does a function wrapping cross-entropy. Where such a mean depends
    on padding or class weights, return ``(sum, count)`` to make it exact."""
    stock = getattr(type(loss_fn), "forward", None) in (nn.CrossEntropyLoss.forward, nn.NLLLoss.forward)
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and stock and loss_fn.reduction == "mean":
        summed = copy.copy(loss_fn)        # the same loss (weights shared), summing
        summed.reduction = "sum"
        return summed, functools.partial(denominator, loss_fn)
    return loss_fn, None


def weighted_loss(result: Any, weight: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a micro-batch's ``loss_fn`` returned (`result`) as the backward's seed, weighted by
    `weight` (ignored for ``(sum, count)``), and its count (None for a plain loss). Raises TypeError,
    saying what to return, for anything but a 0-dim tensor or ``(sum, count)``."""
    count = None
    if isinstance(result, tuple):
        if len(result) != 2:
            raise TypeError(f"loss_fn returned a tuple of {len(result)}; return a scalar tensor or "
                            "(sum, count): the micro-batch's summed loss and what it counts "
                            "(e.g. its non-padding tokens)")
        result, count = result
    if not isinstance(result, torch.Tensor) or result.dim() != 0:
        raise TypeError("loss_fn must return a scalar tensor (0-dim) or (sum, count); use a "
                        "reducing loss")
    if isinstance(count, torch.Tensor) and count.requires_grad:
        raise TypeError("loss_fn returned (sum, count) whose count requires grad: the engine reads a "
                        "pair as the micro-batch's summed loss and the number it counts (e.g. its "
                        "non-padding tokens), and divides the step's loss by the summed counts. To "
                        "log a metric beside the loss, return the loss alone (a 0-dim tensor) and "
                        "compute the metric outside the pipeline")
    loss = upcast(result)
    if count is None and not (isinstance(weight, float) and weight == 1.0):   # x * 1.0 is x
        loss = loss * weight
    return loss, None if count is None else torch.as_tensor(count, dtype=torch.float64).detach()


def loss_weights(sizes: Sequence[int], targets: Sequence[Any], reduction: str,
                 denominator: Callable[[Any], torch.Tensor] | None) -> list[float | torch.Tensor]:
    """Each micro-batch's loss weight: n_m / N for a ``"mean"`` loss, 1 for ``"sum"``, and 1 / the
    mini-batch's denominator for a loss :func:`exact_mean` split, a 0-dim tensor (NaN when the
    denominator is 0: every target ignored, as PyTorch's mean)."""
    n = sum(sizes)
    if denominator is not None:   # summed losses over the mini-batch's denominator
        parts = [denominator(t) for t in targets]
        total = parts[0]
        for part in parts[1:]:
            total = total + part.to(total.device)
        # 1 / total, NaN for 0 (0/0); a positive count c gives c/c = 1 exactly, then 1/c
        weight = total.div(total).div_(total)
        return [weight] * len(sizes)
    return [s / n for s in sizes] if reduction == "mean" else [1.0] * len(sizes)


def own_forward(loss_fn: Any) -> bool:
    """Whether `loss_fn` is a module whose ``forward`` is not one of PyTorch's stock losses' (a
    subclass overriding it, or a module of the user's): the reduction it declares is then its code's
    claim, checked like an undeclared one (:class:`ReductionCheck`)."""
    stock = nn.MSELoss.forward.__module__     # torch.nn.modules.loss: where every stock loss is
    forward = getattr(type(loss_fn), "forward", None)
    return isinstance(loss_fn, nn.Module) and getattr(forward, "__module__", "") != stock


class ReductionCheck:
    """`loss_fn`, whose reduction the engine cannot read from its code (none declared, or one its own
    ``forward`` declares: :func:`own_forward`), checked over two steps' worth of calls (a
    micro-batch's loss may be computed again at its recompute) from the first call where a
    mini-batch is split (`parts()`: its micro-batches over every replica, read at each call until
    the checks start: a pipeline built with one micro-batch, whose loss is any loss's, and given
    more afterwards, ``pipe.micro_batches = 4``, is checked then) to be
    the reduction the pipeline then combines micro-batches by (`declared`, "mean" where None; see the
    module docstring), wherever it returns a 0-dim tensor (a ``(sum, count)`` result is exact and ends
    the checks):

    - integer targets (a tensor, or one of a tuple's) holding :data:`IGNORED_TARGET`, for a mean: a
      function's mean over the targets that count (``F.cross_entropy``'s) would weigh each
      micro-batch by its rows, not by its counted targets;
    - three rows of the micro-batch (its first, middle and last; two rows: both; one row: repeated
      twice), in float64 where the loss computes in it: a per-row mean of them is the mean of each
      one's loss, a sum their sum (a median or another statistic of the rows is neither, which two
      rows could not tell: their median is their mean; a float64 probe sees a small term of batch
      statistics, e.g. a router's load-balancing loss at 0.001, that float32's rounding hid). Where
      an undeclared loss is their sum, it is refused (pass ``loss_reduction="sum"``); where the loss
      is not what it declares or is assumed (class weights, a mean over a mask, padding marked
      otherwise, statistics of the batch), micro-batching changes the loss, and it is refused too
      (``loss_reduction`` accepts combining micro-batches as given, ``(sum, count)`` makes a masked
      mean exact). Rows that agree (no padding in any, equal class weights) cannot tell, so the
      check runs on every micro-batch of the first step, and so does one across micro-batches:
      the first row of each with the first row of the first micro-batch checked (kept until the
      checks end), as rows of one micro-batch may agree where those of two do not (a masked mean
      over a batch sorted by length trained 0.15 off, silently); one whose rows cannot be cut (no output
      tensor with the target's rows, a loss that fails on fewer rows) is skipped, and so is one
      whose rows taken the other way round give another loss (the output's dim 0 is not its rows:
      a time-first (T, n, ...) output with T = n). The targets' rows are cut as the micro-batches
      are (every tensor of a tuple along its first dimension). The probe's memory is the loss of
      three rows, whatever the micro-batch;
    - a loss that is not finite where the outputs are: a mean over no counted target (a micro-batch
      or row all padding), which the full batch's mean is not.

    Each raises ValueError saying what to change; the micro-batch's loss is not used, so the step
    changes nothing, and a call counts toward `checked_calls` only once it passed (a refused step run
    again is checked again). Each check reads the device, during the first step only."""

    def __init__(self, loss_fn: Callable[..., Any], parts: Callable[[], int],
                 declared: str | None = None) -> None:
        self.loss_fn = loss_fn
        self.calls_left: int | None = None     # None: not started (no mini-batch split yet)
        self.parts = parts
        self.declared = declared
        self._kept: tuple[Any, Any] | None = None   # a row of the first micro-batch checked

    def __call__(self, output: Any, target: Any) -> Any:
        result = self.loss_fn(output, target)
        if self.calls_left is None and self.parts() > 1:
            self.calls_left = 2 * self.parts()
        if self.calls_left is not None and self.calls_left > 0:
            if not (isinstance(result, torch.Tensor) and result.dim() == 0):
                self.calls_left = 0     # (sum, count): exact whatever the targets
                return result
            if self.declared != "sum":   # a sum over the targets that count is exact
                refuse_ignored_targets(target, self._claim())
            self._probe_rows(output, target, result)
            self.calls_left -= 1   # counted once passed: a refused step, run again, is checked again
            if self.calls_left == 0:
                self._kept = None
        return result

    def _claim(self) -> str:
        """What the loss says of its reduction, for the messages."""
        if self.declared is None:
            return "loss_fn declares no reduction"
        return (f"loss_fn ({type(self.loss_fn).__name__}) declares reduction={self.declared!r} and has a "
                "forward of its own (the engine runs it as written: it cannot make a weighted or "
                "masked mean exact inside it)")

    def _probe_rows(self, output: Any, target: Any, result: torch.Tensor) -> None:
        batched = [t for t in tensors(target) if t.dim() > 0]
        if not batched or not all(has_values(t) for t in batched) or not has_values(result):
            return
        n = batched[0].shape[0]
        if not any(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n
                   for t in tensors(output)):
            return
        if not math.isfinite(float(result.detach().float())):
            self._refuse_not_finite(output, "a micro-batch", [float(result.detach().float())])
            return
        # Three rows (the first, the middle and the last), each alone and together: the probe's own
        # memory is the loss of three rows, whatever the micro-batch's size (it runs at the step's
        # peak). In float64 where the loss computes in it, else as the step computes it.
        picked = [0, 0] if n == 1 else [0, n - 1] if n == 2 else [0, n // 2, n - 1]
        if self._judge(output, target, picked, n, result):
            self._probe_across(output, target, n, result)

    def _probe_across(self, output: Any, target: Any, n: int, result: torch.Tensor) -> None:
        """The first row of this micro-batch with the first of the first micro-batch checked (kept,
        one row): rows of one micro-batch may agree where those of two do not (a masked mean over a
        batch sorted by length, every micro-batch's rows equally padded)."""
        row = (_rows(output, [0], n), _rows(target, [0], n))
        if self._kept is None:
            self._kept = row
            return
        both = (_cat_rows(row[0], self._kept[0]), _cat_rows(row[1], self._kept[1]))
        if both[0] is not None and both[1] is not None:
            self._judge(both[0], both[1], [0, 1], 2, result)

    def _judge(self, output: Any, target: Any, picked: list[int], n: int, result: torch.Tensor) -> bool:
        """Refuse (ValueError) where the loss of rows `picked` of `output` together is not the
        reduction of each one's (see the class docstring); whether the rows could be judged (False:
        their loss cannot be taken alone, or dim 0 is not the rows)."""
        probed = self._probe(output, target, picked, n, result, torch.float64)
        if probed is None:
            probed = self._probe(output, target, picked, n, result, None)
        if probed is None:
            return False
        values, whole, other, exact = probed
        if not all(math.isfinite(v) for v in (whole, other, *values)):
            self._refuse_not_finite(output, "one row of a micro-batch", [whole, other, *values])
            return False
        as_mean, as_sum = sum(values) / len(values), sum(values)
        low = result.dtype in (torch.float16, torch.bfloat16) or any(
            t.dtype in (torch.float16, torch.bfloat16) for t in tensors(output))
        tolerance = (1e-9 if exact else 2e-2 if low else 1e-4) * max(abs(whole), *(abs(v) for v in values),
                                                                      1e-30)
        if abs(whole - other) > tolerance:
            return False
        expected = as_sum if self.declared == "sum" else as_mean
        if abs(whole - expected) <= tolerance:
            return True
        summing = abs(whole - as_sum) <= tolerance
        if self.declared is None and summing:
            raise ValueError("loss_fn declares no reduction and sums over its rows (rows' "
                             "loss is the sum of each one's), but micro-batch losses are combined as "
                             "means: pass loss_reduction='sum' (or give the loss a .reduction)")
        # a declared reduction contradicted: a sum shows only where neither row's loss is 0 (with
        # one row masked out, a masked mean is their sum too)
        summing = summing and all(abs(v) > tolerance for v in values)
        if self.declared is not None and (summing or abs(whole - as_mean) <= tolerance):
            does = "sum" if summing else "mean"
            raise ValueError(f"{self._claim()}, but it computes a {does} over its rows (rows' loss "
                             f"is the {does} of each one's): set its reduction to {does!r}, which "
                             "combines micro-batch losses as its forward computes them")
        what = "a sum" if self.declared == "sum" else "a mean"
        allowed = (f"pass loss_reduction={self.declared!r} to combine micro-batch losses that way "
                   "anyway" if self.declared else "pass loss_reduction='mean' or 'sum' to combine "
                   "micro-batch losses that way anyway")
        raise ValueError(f"{self._claim()} and is not {what} over its rows: {len(values)} rows together give "
                         f"{whole:.6g}, not the {what[2:]} {expected:.6g} of each one's loss (class "
                         "weights, a mean over a mask, padding, or statistics of the "
                         "batch), so splitting a mini-batch into micro-batches changes it. Return "
                         "(sum, count) to make a masked mean exact, use nn.CrossEntropyLoss / "
                         f"nn.NLLLoss as they are (the engine makes their weighted mean exact), or {allowed}")

    def _probe(self, output: Any, target: Any, picked: list[int], n: int, result: torch.Tensor,
               dtype: torch.dtype | None) -> tuple[list[float], float, float, bool] | None:
        """The loss of each `picked` row alone (a row repeated: the micro-batch's one row), of them
        together and together the other way round; with `dtype`, the outputs' floating tensors cast
        to it first. None where the loss cannot be taken so (its rows tied to its batch's, a loss
        that refuses the dtype, one that is not a 0-dim tensor). Also whether it computed in
        float64 throughout (the results' dtype)."""
        out = output if dtype is None else _cast_floats(output, dtype)
        rows = list(dict.fromkeys(picked))
        with torch.no_grad():
            try:
                if n == 1 and dtype is None:   # the row alone, and twice: a mean gives its loss again
                    parts = [result.detach()]
                else:
                    parts = [self.loss_fn(_rows(out, [i], n), _rows(target, [i], n)) for i in rows]
                together = self.loss_fn(_rows(out, picked, n), _rows(target, picked, n))
                # the same rows the other way round: a loss of rows gives the same; where it does
                # not, the output's dim 0 is not its rows (time-first, (T, n, ...) with T = n) or the
                # loss depends on their order, and the probe cannot tell
                swapped = together if n == 1 else self.loss_fn(_rows(out, picked[::-1], n),
                                                                _rows(target, picked[::-1], n))
            except Exception:     # a loss tied to its batch's rows (a closure over per-row weights)
                return None
            if not all(isinstance(p, torch.Tensor) and p.dim() == 0 for p in (*parts, together, swapped)):
                return None
            exact = all(p.dtype is torch.float64 for p in (*parts, together, swapped))
            if dtype is not None and not exact:
                return None
            values = [float(p.double()) for p in parts] * (2 if n == 1 else 1)
            return values, float(together.double()), float(swapped.double()), exact

    def _refuse_not_finite(self, output: Any, where: str, losses: Sequence[float]) -> None:
        """ValueError where the outputs are finite and a loss is NaN: a mean over no counted target
        (0 / 0). An infinite loss (a log of a probability that underflowed to 0) is the loss's own
        overflow, which plain training meets alike: nothing to tell."""
        if not all(bool(torch.isfinite(t).all()) for t in tensors(output) if t.is_floating_point()):
            return     # the outputs overflowed (fp16's loss scale handles it): nothing to tell
        if not any(math.isnan(v) for v in losses):
            return
        raise ValueError(f"{self._claim()} and gave a loss that is NaN on {where} whose outputs "
                         "are finite: a mean over the targets that count, where those rows have "
                         "none (all padding: 0 / 0), so it is not a per-row mean and splitting a "
                         "mini-batch into micro-batches changes it. Return (sum, count) to make a "
                         "masked mean exact, or use nn.CrossEntropyLoss(ignore_index=...) (the engine "
                         "divides by the whole mini-batch's count); if the loss itself computes a NaN, "
                         "mend it")


class CountedCheck:
    """`loss_fn`, a function or a module with a ``forward`` of its own, whose ``(a, b)`` results are
    checked during its first calls to be ``(sum, count)``: the engine divides the step's summed
    losses by its summed counts, so both must add up over rows. A loss returning ``(mean, accuracy)``
    to log a metric would otherwise train on the loss divided by the accuracy, silently (at any K and
    M, one micro-batch included). Two rows of the micro-batch (its first and last; one row: twice)
    alone and together: the pair of the rows together must be the sum of their pairs, in both
    entries. Each check reads the device, during the first `calls` calls only; a loss whose rows
    cannot be cut (see :class:`ReductionCheck`) is not checked, nor this project's own losses
    (``CausalLMLoss``), which GPipe does not wrap."""

    def __init__(self, loss_fn: Callable[..., Any], calls: int = 2) -> None:
        self.loss_fn = loss_fn
        self.calls_left = calls

    def __call__(self, output: Any, target: Any) -> Any:
        result = self.loss_fn(output, target)
        if self.calls_left > 0 and isinstance(result, tuple) and len(result) == 2:
            self._check(output, target, result)
            self.calls_left -= 1   # counted once passed: a refused step, run again, is checked again
        return result

    def _check(self, output: Any, target: Any, result: tuple[Any, Any]) -> None:
        total, count = result
        if not isinstance(total, torch.Tensor) or total.dim() != 0:
            return                         # weighted_loss refuses it, saying what to return
        if isinstance(count, torch.Tensor) and count.dim() != 0:
            raise TypeError(f"loss_fn returned (sum, count) with a count of shape {tuple(count.shape)}: "
                            "return the micro-batch's summed loss and what it counts as 0-dim tensors "
                            "(or a Python number for the count)")
        if isinstance(count, torch.Tensor) and count.requires_grad:
            return                         # weighted_loss refuses it, saying why
        if not has_values(total) or (isinstance(count, torch.Tensor) and not has_values(count)):
            return                         # shapes only (the memory planner's trace)
        counted = float(torch.as_tensor(count, dtype=torch.float64))
        if not (math.isfinite(counted) and counted >= 0):
            raise ValueError(f"loss_fn returned (sum, count) with count {counted:g}: a count is a number "
                             ">= 0 (the micro-batch's tokens or rows that count)")
        batched = [t for t in tensors(target) if t.dim() > 0]
        if not batched or not all(has_values(t) for t in batched):
            return
        n = batched[0].shape[0]
        if not any(t.dim() > 0 and t.shape[0] == n for t in tensors(output)):
            return
        picked = [0, 0] if n == 1 else [0, n - 1]     # two rows: the probe's memory is theirs
        with torch.no_grad():
            try:
                parts = [self.loss_fn(_rows(output, [i], n), _rows(target, [i], n)) for i in picked]
                together = self.loss_fn(_rows(output, picked, n), _rows(target, picked, n))
                swapped = self.loss_fn(_rows(output, picked[::-1], n), _rows(target, picked[::-1], n))
            except Exception:     # noqa: BLE001 - a loss tied to its batch's rows: not checked
                return
        pairs = [_pair(p) for p in (*parts, together, swapped)]
        if any(p is None for p in pairs):
            return
        *rows, whole, other = pairs
        for i, what in ((0, "sum"), (1, "count")):
            values = [r[i] for r in rows]    # type: ignore[index]
            low = total.dtype in (torch.float16, torch.bfloat16)
            tolerance = (2e-2 if low else 1e-4) * max(abs(whole[i]), *(abs(v) for v in values), 1e-30)  # type: ignore[index]
            if abs(whole[i] - other[i]) > tolerance:   # type: ignore[index]
                return        # the rows the other way round differ: dim 0 is not the rows
            if abs(whole[i] - sum(values)) > tolerance:   # type: ignore[index]
                raise ValueError(
                    f"loss_fn returned a pair, which the engine reads as (sum, count): the micro-batch's "
                    "summed loss and what it counts, the step's loss being the summed losses over the "
                    f"summed counts. Its {what} does not add up over rows: {len(values)} rows together "
                    f"give {whole[i]:.6g}, not the sum {sum(values):.6g} of each one's "  # type: ignore[index]
                    f"({'a mean?' if what == 'sum' else 'a metric, such as an accuracy?'}). Return the "
                    "loss alone (a 0-dim tensor) and compute metrics outside the pipeline, or return "
                    "(summed loss, count)")


def _pair(result: Any) -> tuple[float, float] | None:
    """A ``(sum, count)`` result as two floats, None for anything else."""
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)
            and result[0].dim() == 0):
        return None
    count = torch.as_tensor(result[1])
    if count.dim() != 0:
        return None
    return float(result[0].double()), float(count.double())


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """`value` with every floating tensor cast to `dtype` (detached), the rest as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    return value


def _rows(value: Any, rows: Any, n: int) -> Any:
    """`value` with every tensor of `n` rows cut to `rows` (detached), the rest as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach()[rows] if value.dim() > 0 and value.shape[0] == n else value
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(v, rows, n) for v in value)
    return value


def _cat_rows(a: Any, b: Any) -> Any:
    """Two one-row values (:func:`_rows`'s) as one of two rows; None where their tensors cannot be
    joined (another length or width)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dim() == 0 or b.dim() == 0 or a.shape[0] != 1 or b.shape[0] != 1:
            return a if a.shape == b.shape and torch.equal(a, b) else None
        return torch.cat([a, b.to(a.device)]) if a.shape[1:] == b.shape[1:] and a.dtype == b.dtype else None
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        parts = [_cat_rows(x, y) for x, y in zip(a, b)]
        return None if any(p is None for p, x in zip(parts, a) if x is not None) else type(a)(parts)
    return a if a == b else None


def refuse_ignored_targets(targets: Any, claim: str = "loss_fn declares no reduction") -> None:
    """ValueError if integer `targets` (a tensor, or any of a tuple's) hold :data:`IGNORED_TARGET`
    (see :class:`ReductionCheck`; `claim`: what the loss says of its reduction). One read of the
    device per integer tensor."""
    for t in tensors(targets):
        if has_values(t) and not t.is_floating_point() and t.dtype != torch.bool \
                and bool((t == IGNORED_TARGET).any()):
            raise ValueError(
                f"{claim} and the targets hold {IGNORED_TARGET} (positions cross-entropy ignores): a "
                "function's mean over the targets that count would weigh each micro-batch by its "
                "rows, not by its counted targets, and the step would differ from full-batch "
                "training. Use nn.CrossEntropyLoss(ignore_index=-100) (the engine divides by the "
                "whole mini-batch's count), or return (sum, count), or pass loss_reduction='mean' to "
                "weigh micro-batches by their rows anyway")
