"""Splitting a mini-batch into micro-batches and joining outputs back.

`torch.tensor_split` semantics, not `chunk`: a batch of N >= M examples always gives exactly M
micro-batches whose sizes differ by at most one (N=10, M=4 -> 3,3,2,2). `chunk` would silently give
fewer pieces (N=10, M=4 -> 3,3,3,1 is fine, but N=6, M=4 -> 2,2,2: three), and every later decision
(which micro-batch is last, when BatchNorm commits, how losses are weighted) would then be wrong.

A value is a tensor or a (possibly nested) tuple/list of tensors and plain values. Tensors with a
batch dimension are split along dim 0; 0-dim tensors and non-tensor values are given whole to every
micro-batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["batch_size", "split_sizes", "split", "join", "split_minibatch"]


def rebuild(like: tuple[Any, ...] | list[Any], items: list[Any]) -> Any:
    """A tuple or list of `like`'s type holding `items`: a named tuple (``collections.namedtuple``,
    ``typing.NamedTuple``) takes them as arguments, a ``torch.return_types`` value or a plain tuple
    or list as one sequence."""
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*items)
    return type(like)(items)


def _check_no_mapping(value: Any, what: str) -> None:
    if isinstance(value, dict):
        raise TypeError(f"{what} holds a dict ({sorted(map(str, value))[:4]}); the engine splits "
                        "tensors, tuples and lists along dim 0: pass a tuple of its values instead "
                        "(and rebuild the dict inside the first layer, or the loss)")
    if isinstance(value, (tuple, list)):
        for v in value:
            _check_no_mapping(v, what)


def batch_size(value: Any, what: str = "the batch") -> int:
    """The size of dim 0 shared by every batched tensor in `value` (`what` names it in errors)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:   # one batched tensor: its dim 0
        return value.shape[0]
    _check_no_mapping(value, what)
    sizes = {t.shape[0] for t in _tensors(value) if t.dim() > 0}
    if not sizes:
        raise ValueError(f"{what} holds no tensor with a batch dimension (dim 0) to split: pass a "
                         "tensor, or a tuple or list of tensors, whose dim 0 is the batch")
    if len(sizes) > 1:
        raise ValueError(f"tensors in one batch disagree on the batch size (dim 0): {sorted(sizes)}; "
                         "every batched tensor of an input or a target must have the same dim 0, "
                         "as each is cut along it into the micro-batches. A tensor shared by every "
                         "example (positions, a causal mask) is made inside a layer, or kept as its "
                         "buffer, rather than passed with the batch, or given one row per example "
                         "(position ids of shape (1, T): pass position_ids.expand(N, -1))")
    return sizes.pop()


def split_sizes(n: int, m: int) -> list[int]:
    """Sizes of M micro-batches of a batch of N, as `torch.tensor_split` cuts them."""
    if m < 1:
        raise ValueError(f"micro_batches must be >= 1, got {m}")
    if n < m:
        raise ValueError(f"micro_batches={m} is larger than the batch size {n}: "
                         f"use micro_batches <= {n} or a larger batch")
    return [n // m + (1 if i < n % m else 0) for i in range(m)]


def split(value: Any, m: int) -> list[Any]:
    """Cut `value` into `m` micro-batches along dim 0."""
    split_sizes(batch_size(value), m)  # validates
    return _split(value, m)


def _split(value: Any, m: int) -> list[Any]:
    """:func:`split` of a value already checked to have a batch of at least `m`."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return list(value.tensor_split(m))
    return [_select(value, m, i) for i in range(m)]


def _select(value: Any, m: int, i: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tensor_split(m)[i] if value.dim() > 0 else value
    if isinstance(value, (tuple, list)):
        return rebuild(value, [_select(v, m, i) for v in value])
    return value


def join(values: list[Any], sizes: Sequence[int] | None = None, where: str = "") -> Any:
    """Concatenate micro-batch outputs back into one batch (inverse of :func:`split`). With the
    micro-batches' `sizes`, every tensor must be per example (its dim 0 the micro-batch's rows): a
    tensor that is not (a mean over the batch, a constant matrix) has no batch to join, and is
    refused rather than returned as the first micro-batch's or concatenated."""
    first = values[0]
    if len(values) == 1:
        return first
    if isinstance(first, torch.Tensor):
        if sizes is not None:
            bad = next(((i, v) for i, v in enumerate(values) if v.dim() == 0 or v.shape[0] != sizes[i]),
                       None)
            if bad is not None:
                raise ValueError(
                    f"the model's output{where} has shape {tuple(bad[1].shape)} on a micro-batch of "
                    f"{sizes[bad[0]]} examples: pipelined inference joins the micro-batches' outputs "
                    "along dim 0, so every output tensor must be per example (dim 0 the batch). "
                    "Reduce over the batch after pipe(x), or run it with micro_batches=1")
        return torch.cat(values) if first.dim() > 0 else first
    if isinstance(first, (tuple, list)):
        return rebuild(first, [join([v[j] for v in values], sizes, f"{where}[{j}]")
                               for j in range(len(first))])
    return first


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def target_count(loss_fn: Any, targets: Any) -> float:
    """What fp16 divides a ``(sum, count)`` loss by before scaling it
    (:class:`~gpipe_repro.engine.agreement.StepConfig`): the loss's own ``target_count(targets)``
    where it has one (the count it will return, e.g. :class:`~gpipe_repro.models.hf.CausalLMLoss`'s
    tokens), else the elements of the mini-batch's first target tensor (padding included), at least 1."""
    counter = getattr(loss_fn, "target_count", None)
    if callable(counter):
        return max(1.0, float(counter(targets)))
    found = _tensors(targets)
    return float(max(1, found[0].numel())) if found else 1.0


def split_minibatch(inputs: Any, targets: Any, micro_batches: int,
                    replicas: int = 1) -> tuple[list[Any], list[Any], list[int]]:
    """A training mini-batch as R x M micro-batches of inputs and of targets (None for each when
    `targets` is None: a loss that reads only the output), and their sizes. Raises ValueError,
    saying what to change, when the batch is smaller than R x M or the targets' batch differs."""
    n = batch_size(inputs, "the input")
    parts = micro_batches * replicas
    if parts > n:
        if replicas > 1:
            raise ValueError(f"micro_batches={micro_batches} x replicas={replicas} = {parts} "
                             f"micro-batches is more than the global batch size {n}: use a global "
                             f"batch of at least {parts}, or fewer micro-batches")
        raise ValueError(f"micro_batches={micro_batches} is larger than the batch size {n}: "
                         f"use micro_batches <= {n} or a larger batch")
    if targets is not None and (t := batch_size(targets, "the target batch")) != n:
        raise ValueError(f"targets have batch size {t} but inputs {n}")
    return (_split(inputs, parts), [None] * parts if targets is None else _split(targets, parts),
            split_sizes(n, parts))
