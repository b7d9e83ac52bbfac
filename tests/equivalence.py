"""The plain-PyTorch reference every pipeline is compared against. It imports NO engine code.

`reference_train` trains the same layers for several steps as a user would by hand, following the
documented rules (docs/design.md) with its own implementation of each:

- micro-batches: its own `torch.tensor_split` of every batched tensor (0-dim tensors and plain values
  given whole to every micro-batch);
- dropout masks: before layer i runs on micro-batch m of step t, the CPU generator is seeded with
  :func:`rule_seed` (seed, t, i, m), written here from the rule's description (SplitMix64 chain);
- loss: micro-batch m weighted n_m/N ("mean") or 1 ("sum"); a ``(sum, count)`` loss gives
  sum of sums / sum of counts; ONE backward of the whole mini-batch's loss per step;
- BatchNorm: normalization per micro-batch (plain BatchNorm in train mode), running statistics
  restored and then updated ONCE per step, by a plain BatchNorm forward over the concatenation of all
  the inputs that layer saw in the step;
- one optimizer over all parameters, `torch.nn.utils.clip_grad_norm_` before it when asked.

`assert_same_training` builds a GPipe and the reference from one model, runs `steps` steps on each,
and compares every loss, and after the last step every gradient, parameter and buffer, under every
name a parameter has: a parameter tied across cells is compared in each cell holding a copy (each
copy's value and gradient are the tied parameter's), and the copies must be bit-identical.
"""
from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_repro import GPipe

RTOL, ATOL = 1e-5, 1e-6
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finalizer (Steele, Lea & Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014; constants from Vigna's splitmix64.c)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def rule_seed(seed: int, step: int, layer: int, microbatch: int) -> int:
    """The documented rule: mix(mix(mix(mix(seed) ^ step) ^ layer) ^ microbatch), low 63 bits."""
    h = _mix(_mix(seed & _M64) ^ (step & _M64))
    h = _mix(h ^ (layer & _M64))
    return _mix(h ^ (microbatch & _M64)) & ((1 << 63) - 1)


def split_batch(value: Any, m: int) -> list[Any]:
    """M micro-batches of `value` along dim 0 (torch.tensor_split), structure kept."""
    def pick(v: Any, i: int) -> Any:
        if isinstance(v, torch.Tensor):
            return v.tensor_split(m)[i] if v.dim() > 0 else v
        if isinstance(v, (tuple, list)):
            return type(v)(pick(x, i) for x in v)
        return v
    return [pick(value, i) for i in range(m)]


def _rows(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.shape[0]
    return next(_rows(v) for v in value if isinstance(v, (torch.Tensor, tuple, list)) and
                (not isinstance(v, torch.Tensor) or v.dim() > 0))


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def sgd_momentum(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def reference_train(layers: list[nn.Module], batches: Sequence[tuple[Any, Any]], loss_fn: Callable,
                    micro_batches: int, optimizer: Callable[[Any], torch.optim.Optimizer] = sgd,
                    seed: int = 0, loss_reduction: str = "mean",
                    clip_grad_norm: float | None = None,
                    autocast: torch.dtype | None = None, first_step: int = 0) -> list[float]:
    """Train `layers` (in place) on `batches`, one step each (numbered from `first_step`); return
    the step losses."""
    model = nn.Sequential(*layers).train()
    params = list(model.parameters())
    opt = optimizer(params)
    bns = [mod for mod in model.modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)]
    losses = []
    for step, (inputs, targets) in enumerate(batches, start=first_step):
        saved = [(bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
                 if bn.track_running_stats else None for bn in bns]
        seen: list[list[torch.Tensor]] = [[] for _ in bns]
        def keep(j: int, seen: list[list[torch.Tensor]] = seen) -> Callable:
            return lambda mod, inp: seen[j].append(inp[0].detach())
        hooks = [bn.register_forward_pre_hook(keep(j)) for j, bn in enumerate(bns)]
        for p in params:
            p.grad = None
        xs, ts = split_batch(inputs, micro_batches), split_batch(targets, micro_batches)
        n = sum(_rows(t) for t in ts)
        terms, counts = [], []
        for m, (x, t) in enumerate(zip(xs, ts)):
            h = _clone(x)   # a user's own copy: the caller's batch must not change
            with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
                for i, layer in enumerate(layers):
                    torch.manual_seed(rule_seed(seed, step, i, m))
                    h = layer(h)
                out = loss_fn(h, t)
            if isinstance(out, tuple):
                terms.append(out[0].float())
                counts.append(torch.as_tensor(out[1], dtype=torch.float64))
            else:
                terms.append(out.float() * (_rows(t) / n if loss_reduction == "mean" else 1.0))
        for hook in hooks:
            hook.remove()
        total = sum(terms)
        if counts:
            total = total / float(sum(counts))
        total.backward()  # type: ignore[union-attr]
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        opt.step()
        with torch.no_grad():  # BatchNorm: one update per step from everything it saw
            for bn, before, inputs_seen in zip(bns, saved, seen):
                if before is None or not inputs_seen:
                    continue
                mean, var, tracked = before
                tracked += 1
                momentum = 1.0 / float(tracked) if bn.momentum is None else bn.momentum
                torch.nn.functional.batch_norm(torch.cat(inputs_seen).float(), mean, var, training=True,
                                               momentum=momentum, eps=bn.eps)
                bn.running_mean.copy_(mean)
                bn.running_var.copy_(var)
                bn.num_batches_tracked.copy_(tracked)
        losses.append(float(total.detach()))  # type: ignore[union-attr]
    return losses


def reference_step(layers: list[nn.Module], inputs: Any, targets: Any, loss_fn: Callable,
                   micro_batches: int, lr: float = 0.1, seed: int = 0, step: int = 0,
                   loss_reduction: str = "mean") -> float:
    """One plain SGD step of :func:`reference_train` numbered `step`; returns its loss."""
    return reference_train(layers, [(inputs, targets)], loss_fn, micro_batches,
                           lambda ps: torch.optim.SGD(ps, lr=lr), seed=seed,
                           loss_reduction=loss_reduction, first_step=step)[0]


def assert_same_training(layers: list[nn.Module], inputs: Any, targets: Any, loss_fn: Callable,
                         partitions: int, micro_batches: int, checkpoint: str,
                         loss_reduction: str | None = None, rtol: float = RTOL, atol: float = ATOL,
                         steps: int = 1, optimizer: Callable[[Any], torch.optim.Optimizer] = sgd,
                         batches: Sequence[tuple[Any, Any]] | None = None,
                         **gpipe_kwargs: Any) -> GPipe:
    """`steps` training steps of GPipe vs the reference (each step on the same batch unless
    `batches` is given); compare every loss, then every gradient, parameter and buffer."""
    batches = list(batches) if batches is not None else [(inputs, targets)] * steps
    keep = [(_clone(x), _clone(y)) for x, y in batches]
    ref_layers = copy.deepcopy(layers)
    reduction = loss_reduction or getattr(loss_fn, "reduction", "mean")
    reference_args = dict(loss_reduction=reduction if reduction in ("mean", "sum") else "mean",
                          clip_grad_norm=gpipe_kwargs.get("clip_grad_norm"),
                          autocast={"bf16": torch.bfloat16, "fp16": torch.float16}.get(
                              gpipe_kwargs.get("precision", "fp32")))
    key = _reference_key(ref_layers, keep, loss_fn, micro_batches, optimizer,
                         tuple(sorted(reference_args.items())))
    kwargs = dict(gpipe_kwargs)
    if loss_reduction is not None:
        kwargs["loss_reduction"] = loss_reduction
    pipe = GPipe(copy.deepcopy(layers), partitions=partitions, micro_batches=micro_batches,
                 checkpoint=checkpoint, loss_fn=loss_fn, optimizer=optimizer, **kwargs)
    losses = [pipe.train_step(x, y) for x, y in batches]
    for (x, y), (x0, y0) in zip(batches, keep):
        _assert_equal_values(x, x0, "the caller's inputs were modified")
        _assert_equal_values(y, y0, "the caller's targets were modified")
    ref_losses, ref_params, ref_buffers = _reference(ref_layers, batches, loss_fn, micro_batches, optimizer,
                                                     key, **reference_args)
    where = f"K={partitions} M={micro_batches} checkpoint={checkpoint} balance={pipe.balance}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda msg: f"losses differ ({where}): {msg}")
    ours = dict(pipe.unpartitioned().named_parameters(remove_duplicate=False))
    theirs = ref_params
    assert ours.keys() == theirs.keys()
    for name in ours:
        g, (value, rg) = ours[name].grad, theirs[name]
        assert (g is None) == (rg is None), f"{name}: gradient presence differs ({where})"
        if g is not None:
            torch.testing.assert_close(g, rg, rtol=rtol, atol=atol,
                                       msg=lambda msg, name=name: f"grad of {name} differs ({where}): {msg}")
        torch.testing.assert_close(ours[name].detach(), value, rtol=rtol, atol=atol,
                                   msg=lambda msg, name=name: f"updated {name} differs ({where}): {msg}")
    our_buffers = dict(pipe.unpartitioned().named_buffers())
    for name, buf in ref_buffers.items():
        torch.testing.assert_close(our_buffers[name].float(), buf.float(), rtol=rtol, atol=atol,
                                   msg=lambda msg, name=name: f"buffer {name} differs ({where}): {msg}")
    assert_copies_identical(pipe)
    return pipe


def tied_copies(pipe: GPipe) -> list[list[torch.nn.Parameter]]:
    """The copies this process holds of each parameter tied across cells (`pipe.ties`: each tie's
    (cell, name) holders)."""
    return [[pipe.cells[c].get_parameter(name) for c, name in tie.holders if len(pipe.cells[c]) > 0]
            for tie in pipe.ties]


def assert_copies_identical(pipe: GPipe) -> None:
    """Each tied parameter's copies: distinct objects, bit-identical values and gradients."""
    for copies in tied_copies(pipe):
        first = copies[0]
        for p in copies[1:]:
            assert p is not first, "a tied parameter's copies are distinct parameters"
            assert torch.equal(p.detach().cpu(), first.detach().cpu()), "tied copies differ"
            assert (p.grad is None) == (first.grad is None), "tied copies' gradient presence differs"
            if p.grad is not None and first.grad is not None:
                assert torch.equal(p.grad.cpu(), first.grad.cpu()), "tied copies' gradients differ"


# Reference runs already made in this process, by everything a run depends on (_reference_key): the
# same reference is asked for by every K and checkpoint mode compared against it (in
# tests/engine/test_equivalence.py 108 comparisons need 18 references). reference_train is
# deterministic on the CPU (each layer's dropout masks come from rule_seed, its inputs are the
# caller's), so a stored run is exactly what running it again gives; the CPU generator's state it
# leaves behind is stored and restored too. Keys hold the loss, optimizer and module classes
# themselves, so their identities cannot be reused by other objects while an entry lives.
_REFERENCES: dict[tuple[Any, ...], tuple[list[float], dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                                          dict[str, torch.Tensor], torch.Tensor]] = {}


def _fingerprint(value: Any) -> Any:
    """A hashable stand-in for what a reference run reads of `value`: each tensor's dtype, shape,
    requires_grad, device and bytes; each module's class (the object: its forward), mode, public
    attributes (a head count kept beside equal-shaped weights) and hooks, recursively."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        data = flat.to(torch.uint8) if flat.dtype == torch.bool else flat.view(torch.uint8)
        return ("tensor", value.dtype, tuple(value.shape), value.requires_grad, value.device.type,
                hashlib.sha1(data.numpy().tobytes()).hexdigest())
    if isinstance(value, nn.Module):
        attrs = tuple(sorted((k, _fingerprint(v)) for k, v in vars(value).items()
                             if not k.startswith("_") and k != "training"))
        hooks = tuple(tuple(getattr(value, name).values()) for name in
                      ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                       "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"))
        return ("module", type(value), value.training, attrs, hooks,
                tuple((k, _fingerprint(v)) for k, v in value._parameters.items()),
                tuple((k, _fingerprint(v)) for k, v in value._buffers.items()),
                tuple((k, _fingerprint(v)) for k, v in value._modules.items()))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_fingerprint(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _fingerprint(v)) for k, v in value.items()))
    try:
        hash(value)
        return value                # held by the key: its identity stays its own
    except TypeError:
        return ("unhashable", type(value), repr(value))


def _reference_key(layers: list[nn.Module], batches: Sequence[tuple[Any, Any]],
                   *args: Any) -> tuple[Any, ...]:
    """The key of a reference run: the layers, which of their modules, parameters and buffers are
    one object (a layer listed twice trains differently from two equal copies), the batches and the
    other arguments."""
    objects = [o for layer in layers for _, m in layer.named_modules(remove_duplicate=False)
               for o in (m, *m._parameters.values(), *m._buffers.values()) if o is not None]
    first: dict[int, int] = {}
    sharing = tuple(first.setdefault(id(o), i) for i, o in enumerate(objects))
    return (_fingerprint(layers), sharing, _fingerprint(list(batches)), *args)


def _reference(layers: list[nn.Module], batches: Sequence[tuple[Any, Any]], loss_fn: Callable,
               micro_batches: int, optimizer: Callable[[Any], torch.optim.Optimizer], key: tuple[Any, ...],
               **kwargs: Any) -> tuple[list[float], dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                                       dict[str, torch.Tensor]]:
    """:func:`reference_train` of `layers` (trained in place) on `batches`: (losses, every parameter's
    value and gradient, every buffer), made once per `key` (see _REFERENCES)."""
    if key not in _REFERENCES:
        losses = reference_train(layers, batches, loss_fn, micro_batches, optimizer, **kwargs)
        model = nn.Sequential(*layers)
        params = {name: (p.detach().clone(), None if p.grad is None else p.grad.clone())
                  for name, p in model.named_parameters(remove_duplicate=False)}
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        _REFERENCES[key] = (losses, params, buffers, torch.get_rng_state())
    losses, params, buffers, rng = _REFERENCES[key]
    torch.set_rng_state(rng)
    return losses, params, buffers


def _assert_equal_values(a: Any, b: Any, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    elif isinstance(a, (tuple, list)):
        for x, y in zip(a, b):
            _assert_equal_values(x, y, what)
