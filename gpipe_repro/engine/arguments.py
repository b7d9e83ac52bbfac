"""The checks of :class:`~gpipe_repro.engine.gpipe.GPipe`'s arguments.

Every check runs before any work starts (no partitioner, no process group, no optimizer), and every
error says what to change. :func:`check_arguments` covers the scalar configuration (K, M, the
re-materialization mode, the loss's reduction, clipping, precision, schedule, runtime, objective,
replicas, devices) and builds the schedule once, so that a schedule that cannot serve this K and M
(interleaved 1F1B's M a multiple of K, DualPipeV's M >= 2K) is refused at construction;
:func:`compile_options` the ``compile`` argument against that schedule; :func:`as_layers` the model;
:func:`batch_key` what every rank's mini-batch must share when there are replicas;
:func:`check_sample_target` the targets of the partitioner's sample.
"""
from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine import microbatch
from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.partition import OBJECTIVES
from gpipe_repro.engine.placement import RUNTIMES
from gpipe_repro.engine.precision import PRECISIONS
from gpipe_repro.engine.schedule import (
    CHECKPOINT_MODES,
    SCHEDULES,
    SPLIT_SCHEDULES,
    ActionKind,
    Schedule,
    check_split_backwards,
    make_schedule,
    num_processes,
)
from gpipe_repro.engine.stand_ins import shown_to_optimizer

__all__ = ["BATCHNORM_STATS", "as_layers", "batch_key", "check_arguments", "check_auto_split",
           "check_batch_first", "check_materialized", "check_running_statistics", "check_sample_target",
           "compile_options", "declared_reduction", "layer_shapes", "loss_signature", "optimizer_signature",
           "same_everywhere"]

BATCHNORM_STATS = ("per_replica", "synchronized")   # GPipe(batchnorm_stats=...), with replicas


def as_layers(layers: nn.Sequential | Sequence[nn.Module]) -> list[nn.Module]:
    """Validate a model given as a sequence of layers and return it as a list."""
    if isinstance(layers, nn.Sequential):
        out = list(layers)
    elif isinstance(layers, (list, tuple)):
        out = list(layers)
    else:
        raise TypeError(f"the model must be an nn.Sequential or a list of nn.Module, got "
                        f"{type(layers).__name__}; wrap its parts in nn.Sequential(...)")
    if not out:
        raise ValueError("the model has no layers")
    for i, layer in enumerate(out):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layer {i} is a {type(layer).__name__}, not an nn.Module")
    return out


def layer_shapes(layers: Sequence[nn.Module]) -> list[tuple[Any, ...]]:
    """Each layer's index, type and parameters' names, shapes and dtypes: what every process of a
    distributed pipeline must have built alike (the values are compared later, per stage)."""
    return [(i, type(layer).__name__,
             tuple((name, "lazy" if nn.parameter.is_lazy(p) else tuple(p.shape), str(p.dtype))
                   for name, p in layer.named_parameters()))
            for i, layer in enumerate(layers)]


def same_everywhere(value: Any) -> Any:
    """`value` as every process of a job describes it alike: a function or class by its module and
    qualified name (its repr holds an address, which differs between processes), a dict by its
    sorted items, other objects by their type's name and their repr stripped of addresses."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, Mapping):
        return sorted((str(k), same_everywhere(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [same_everywhere(v) for v in value]
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return re.sub(r" at 0x[0-9a-f]+", "", f"{type(value).__qualname__}: {value!r}")


def check_materialized(layers: Sequence[nn.Module]) -> None:
    """Refuse lazy parameters where the partitioner must size the layers (no `balance` given)."""
    for i, layer in enumerate(layers):
        lazy = next((name for name, p in layer.named_parameters() if nn.parameter.is_lazy(p)), None)
        if lazy is not None:
            raise ValueError(f"layer {i}'s parameter {lazy} is lazy (not yet materialized: nn.Lazy* "
                             "modules leave it until their first forward), so the partitioner cannot "
                             "size the layer: run the model once on a sample batch before GPipe(...), "
                             "or give the cut as balance=[...]")


def declared_reduction(loss_fn: Any) -> str | None:
    """The reduction a loss declares (``nn.CrossEntropyLoss(reduction=...)``), normalized; None if
    it declares none. Raises for a loss that does not reduce."""
    declared = getattr(loss_fn, "reduction", None)
    if not isinstance(declared, str):
        return None
    if declared == "batchmean":   # nn.KLDivLoss: sum / batch size, a per-example mean
        return "mean"
    if declared not in ("mean", "sum"):
        raise ValueError(f"loss_fn has reduction={declared!r}; the pipeline needs a scalar loss per "
                         "micro-batch: use reduction='mean' or 'sum', or return (sum, count)")
    return declared


def check_arguments(*, num_layers: int, partitions: Any, micro_batches: Any, checkpoint: Any,
                    loss_fn: Any, loss_reduction: Any, clip_grad_norm: Any, precision: Any,
                    schedule: Any, recompute_ahead: bool = False, split_backwards: Any = None,
                    seed: Any = 0, runtime: Any,
                    objective: Any, replicas: Any, batchnorm_stats: Any, bucket_cap_mb: Any,
                    devices: Sequence[Any] | None) -> Schedule:
    """Check GPipe's configuration (the arguments of the same names; `num_layers` is the model's
    length) and return the training schedule it runs. Raises ValueError naming the first argument
    out of range or inconsistent, and what to change; checked in the order of GPipe's signature, so
    the message for a given call is stable."""
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be an integer >= 1, got {partitions!r}")
    if partitions > num_layers:
        raise ValueError(f"partitions={partitions} is larger than the number of layers "
                         f"({num_layers}): use partitions <= {num_layers}, or split the "
                         "model into more, smaller layers")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    require_one_of("checkpoint", checkpoint, CHECKPOINT_MODES)
    if loss_reduction not in (None, "mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if isinstance(loss_fn, nn.Module) and any(p.requires_grad for p in loss_fn.parameters()):
        names = [n for n, p in loss_fn.named_parameters() if p.requires_grad]
        raise ValueError(f"loss_fn has trainable parameters ({', '.join(names[:3])}); no cell's "
                         "optimizer holds them, so they would never be updated: move them into the "
                         "model's last layer (e.g. a module that scales the logits), or freeze them "
                         "(requires_grad_(False))")
    declared = declared_reduction(loss_fn)
    if declared is not None and loss_reduction is not None and loss_reduction != declared:
        raise ValueError(f"loss_fn has reduction={getattr(loss_fn, 'reduction', None)!r} but "
                         f"loss_reduction={loss_reduction!r}: leave loss_reduction out (it is read "
                         f"from the loss), or build the loss with reduction={loss_reduction!r}")
    if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float))
                                           and clip_grad_norm > 0):
        raise ValueError(f"clip_grad_norm must be a number > 0 (or None), got {clip_grad_norm!r}")
    require_one_of("precision", precision, PRECISIONS)
    require_one_of("schedule", schedule, SCHEDULES)
    num_processes(schedule, partitions)   # interleaved / zb-v: cells per process must divide
    auto = isinstance(split_backwards, str) and split_backwards == "auto"
    if isinstance(split_backwards, str) and not auto:
        raise ValueError(f"split_backwards must be a count (0 to micro_batches), None (every backward "
                         f"split) or 'auto', got {split_backwards!r}")
    if auto and schedule not in SPLIT_SCHEDULES:
        check_split_backwards(schedule, split_backwards)   # raises: a schedule with nothing to split
    check_split_backwards(schedule, None if auto else split_backwards)
    if not auto and split_backwards is not None and split_backwards > micro_batches:
        raise ValueError(f"split_backwards={split_backwards} is more than micro_batches={micro_batches}: "
                         f"use at most {micro_batches} (every micro-batch split, as None does)")
    try:   # what the schedule needs of M (interleaved: a multiple of K; dualpipe-v: M >= 2K)
        training_schedule = make_schedule(schedule, partitions, micro_batches, checkpoint, recompute_ahead,
                                          None if auto else split_backwards)
    except ValueError as e:
        raise ValueError(f"schedule={schedule!r} with partitions={partitions} and micro_batches="
                         f"{micro_batches}: {e}") from e
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    require_one_of("runtime", runtime, RUNTIMES)
    require_one_of("objective", objective, OBJECTIVES)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    if replicas > 1 and runtime != "distributed":
        raise ValueError(f"replicas={replicas} needs runtime='distributed' (one process per stage "
                         f"of each replica, {partitions * replicas} processes); the local runtime "
                         "runs one pipeline: use replicas=1, or runtime='distributed'")
    require_one_of("batchnorm_stats", batchnorm_stats, BATCHNORM_STATS)
    if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
        raise ValueError(f"bucket_cap_mb must be a number > 0, got {bucket_cap_mb!r}")
    if devices is not None and len(devices) != partitions:
        raise ValueError(f"{len(devices)} devices given for partitions={partitions}: give one device "
                         "per partition")
    return training_schedule


# torch.compile's arguments that GPipe(compile={...}) passes on; modes that record CUDA graphs.
COMPILE_ARGUMENTS = ("backend", "mode", "fullgraph", "dynamic", "options")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_options(compile: Any, schedule: Schedule) -> dict[str, Any] | None:
    """``GPipe(compile=...)`` as ``torch.compile``'s keyword arguments for each layer, or None (no
    compilation): False or None: none; True: torch.compile's defaults; a string: its ``mode``; a
    mapping: its arguments (:data:`COMPILE_ARGUMENTS`). Refused, saying what to use instead:

    - modes that record CUDA graphs (:data:`CUDA_GRAPH_MODES`, or ``options={"triton.cudagraphs":
      True}``): a replay overwrites the previous replay's outputs, and a pipeline keeps several
      micro-batches' activations alive at once (every schedule, M > 1), to be read by their backward;
    - a schedule that splits backwards in two (zero bubble, `schedule`'s BACKWARD_INPUT actions): a
      compiled layer's backward is one autograd node computing its input and weight gradients
      together, inside which the split cannot defer the weight gradients.
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        options: dict[str, Any] = {}
    elif isinstance(compile, str):
        options = {"mode": compile}
    elif isinstance(compile, Mapping):
        options = dict(compile)
    else:
        raise ValueError(f"compile must be True, False, a torch.compile mode (e.g. 'default', "
                         f"'max-autotune-no-cudagraphs') or a dict of torch.compile arguments, got "
                         f"{compile!r}")
    unknown = sorted(set(options) - set(COMPILE_ARGUMENTS))
    if unknown:
        raise ValueError(f"compile={compile!r}: {unknown} are not torch.compile arguments GPipe passes "
                         f"on; use {list(COMPILE_ARGUMENTS)}")
    _check_compile_values(compile, options)
    graphs = options.get("mode") in CUDA_GRAPH_MODES or options.get("backend") == "cudagraphs" or (
        options.get("options") or {}).get("triton.cudagraphs")
    if graphs:
        raise ValueError(f"compile={compile!r} records CUDA graphs, whose replays overwrite the previous "
                         "replay's outputs, and a pipeline keeps several micro-batches' activations "
                         "alive at once: use mode='default' or 'max-autotune-no-cudagraphs' (backend "
                         "'inductor')")
    if any(a.kind is ActionKind.BACKWARD_INPUT for actions in schedule.stages for a in actions):
        raise ValueError(f"compile={compile!r} with schedule={schedule.name!r}: a compiled layer's "
                         "backward is one autograd node computing its input and weight gradients "
                         "together, inside which the zero-bubble split cannot defer the weight "
                         "gradients; use schedule='1f1b' or 'gpipe' with compile, split_backwards=0 "
                         "(every backward whole), or compile=False")
    return options


def _check_compile_values(compile: Any, options: Mapping[str, Any]) -> None:
    """Raise ValueError, naming the choices, for a mode or a backend torch.compile does not know, and
    for a mode given with options (torch.compile takes one or the other): torch's own errors would
    come as its exception types, or only at the first step."""
    import torch._dynamo
    import torch._inductor

    mode = options.get("mode")
    if mode is not None:
        modes = list(torch._inductor.list_mode_options())
        if mode not in modes:
            raise ValueError(f"compile={compile!r}: {mode!r} is not a torch.compile mode; use one of "
                             f"{', '.join(m for m in modes if m not in CUDA_GRAPH_MODES)} (or True for "
                             "torch.compile's defaults)")
        if options.get("options"):
            raise ValueError(f"compile={compile!r}: torch.compile takes a mode or options, not both; "
                             "drop one")
    backend = options.get("backend")
    if isinstance(backend, str):
        backends = torch._dynamo.list_backends(exclude_tags=())
        if backend not in backends:
            raise ValueError(f"compile={compile!r}: {backend!r} is not a torch.compile backend here; "
                             f"use one of {', '.join(backends)}")
    elif backend is not None and not callable(backend):
        raise ValueError(f"compile={compile!r}: a backend is a name or a callable, got "
                         f"{type(backend).__name__}")


def check_running_statistics(layers: Sequence[nn.Module], micro_batches: int, checkpoint: str) -> None:
    """Refuse a layer known to change its state in every training forward where the pipeline would
    do so otherwise than full-batch training: once per micro-batch (M > 1) and again on each
    recompute. GPipe defers BatchNorm's statistics to one update per step (DeferredBatchNorm); an
    InstanceNorm's running statistics and spectral normalization's power iteration (both of
    ``torch.nn.utils.spectral_norm`` and ``torch.nn.utils.parametrizations.spectral_norm``) are not
    deferred. Any other layer that changes a buffer in its forward is refused by the stage executor
    when it first does (:class:`~gpipe_repro.engine.layer_state.BufferWatch`)."""
    if micro_batches == 1 and checkpoint != "always":
        return
    for i, layer in enumerate(layers):
        for name, mod in layer.named_modules():
            what = _stateful_forward(mod)
            if what is None:
                continue
            where = f"layer {i} (" + (f"{name}: " if name else "") + f"{type(mod).__name__})"
            raise ValueError(
                f"{where} {what} in every training forward, so with micro_batches="
                f"{micro_batches} and checkpoint={checkpoint!r} it would do so once per micro-batch and "
                "again on each recompute, unlike full-batch training. "
                + ("Use track_running_stats=False (InstanceNorm's default), or "
                   if isinstance(mod, nn.modules.instancenorm._InstanceNorm) else "Use ")
                + "micro_batches=1 with checkpoint='never' or 'except_last'")


def check_batch_first(layers: Sequence[nn.Module], parts: int) -> None:
    """Refuse, before any work, a layer that takes its input sequence-first (PyTorch's RNNs,
    ``nn.MultiheadAttention`` and Transformer layers with ``batch_first=False``, their default) where
    the mini-batch is cut (`parts` = micro-batches x replicas > 1): the pipeline cuts every tensor
    along dim 0, which is their time, so each micro-batch would hold some time steps of every
    sequence (a 6-step sequence-first encoder trained a loss 0.011 off full-batch training, its
    gradients 0.044, and inference differed by 0.32, silently). The layer itself is checked and, in
    an ``nn.Sequential`` (or a Transformer encoder's or decoder's stack), the modules its input
    reaches as it is; a module of the user's that transposes before calling one is not refused."""
    if parts <= 1:
        return
    for i, layer in enumerate(layers):
        for name, mod in _entry_modules(layer, ""):
            if not _sequence_first(mod):
                continue
            where = f"layer {i} (" + (f"{name}: " if name else "") + f"{type(mod).__name__})"
            raise ValueError(
                f"{where} takes its input sequence-first (batch_first=False, PyTorch's default): its "
                "dim 0 is time, and the pipeline cuts every tensor along dim 0 into micro-batches, so "
                "each would hold some time steps of every sequence, unlike full-batch training. Build "
                "it with batch_first=True and give the pipeline batch-first tensors (inputs and "
                "targets), or wrap it in a module that transposes to (time, batch, ...) and back")


def _entry_modules(mod: nn.Module, name: str) -> Any:
    """`mod` and, through containers that pass their input on unchanged (``nn.Sequential``, a
    Transformer's stack of layers), the modules that input reaches first, with their names."""
    yield name, mod
    if isinstance(mod, nn.Sequential):
        for child_name, child in mod.named_children():
            yield from _entry_modules(child, f"{name}.{child_name}" if name else child_name)
    elif isinstance(mod, (nn.TransformerEncoder, nn.TransformerDecoder)) and len(mod.layers) > 0:
        yield from _entry_modules(mod.layers[0], f"{name}.layers.0" if name else "layers.0")


def _sequence_first(mod: nn.Module) -> bool:
    """Whether `mod` is one of PyTorch's layers built to take (time, batch, ...) input."""
    if isinstance(mod, (nn.RNNBase, nn.MultiheadAttention, nn.Transformer)):
        return not mod.batch_first
    if isinstance(mod, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return not mod.self_attn.batch_first
    return False


def _stateful_forward(mod: nn.Module) -> str | None:
    """What `mod` updates in each training forward, if it is one of the known such layers."""
    from torch.nn.utils import parametrizations, parametrize
    from torch.nn.utils.spectral_norm import SpectralNorm
    if isinstance(mod, nn.modules.instancenorm._InstanceNorm) and mod.track_running_stats:
        return "with track_running_stats=True updates its running statistics"
    if any(isinstance(hook, SpectralNorm) for hook in mod._forward_pre_hooks.values()):
        return "runs spectral normalization's power iteration (torch.nn.utils.spectral_norm)"
    lists: Any = getattr(mod, "parametrizations", None) if parametrize.is_parametrized(mod) else None
    if lists is not None and any(isinstance(p, parametrizations._SpectralNorm)
                                 for plist in lists.values() for p in plist):
        return "runs spectral normalization's power iteration (parametrizations.spectral_norm)"
    return None


def batch_key(inputs: Any, targets: Any) -> Any:
    """What every rank's global mini-batch must have in common with replicas: structure, shapes,
    dtypes and plain values (not the data; reading it would cost a pass over the batch)."""
    def describe(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), str(v.dtype))
        if isinstance(v, (tuple, list)):
            return tuple(describe(x) for x in v)
        return ("value", repr(v))
    return (describe(inputs), describe(targets))


def check_auto_split(split_backwards: Any, sample: Any, cost: Any, balance: Any = None) -> None:
    """``split_backwards="auto"`` times the layers on the sample: refuse it without one, or beside a
    `cost` that is not timed (which matters only where the cut is not given)."""
    if not (isinstance(split_backwards, str) and split_backwards == "auto"):
        return
    if sample is None:
        raise ValueError("split_backwards='auto' chooses the count from the layers timed on a sample: "
                         "give sample= (one micro-batch of inputs), or a count (0 to micro_batches)")
    if cost is not None and cost != "time" and balance is None:
        shown = f"cost={cost!r}" if isinstance(cost, str) else "a list of costs"
        raise ValueError(f"split_backwards='auto' times the layers, and cuts by those times unless "
                         f"balance= is given; {shown} asks for another cut: leave cost out (or "
                         "cost='time'), give balance=, or give a count instead of 'auto'")


def check_sample_target(sample: Any, sample_target: Any, loss_fn: Any,
                        cost: Any = None) -> tuple[Any, Any] | None:
    """``(loss_fn, sample_target)`` for the partitioner's measured costs (the loss timed with the last
    layer), or None without `sample_target`; refuses a target without a sample or a loss, with a
    `cost` that does not run the loss, or whose rows differ from the sample's."""
    if sample_target is None:
        return None
    if cost is not None and (not isinstance(cost, str) or cost not in ("time", "flops")):
        shown = f"cost={cost!r}" if isinstance(cost, str) else "a list of costs"
        raise ValueError(f"sample_target is used only by cost='time' or 'flops' (the loss timed or "
                         f"counted with the last layer), not by {shown}: leave it out, or use one of "
                         "those costs")
    if sample is None:
        raise ValueError("sample_target was given without sample: give sample= (the input batch the "
                         "costs are measured on) with it, or leave sample_target out")
    if loss_fn is None:
        raise ValueError("sample_target was given without loss_fn: the target is for timing the loss "
                         "with the last layer; give loss_fn=, or leave sample_target out")
    rows = microbatch.batch_size(sample, "sample")
    target_rows = microbatch.batch_size(sample_target, "sample_target")
    if rows != target_rows:
        raise ValueError(f"sample_target has {target_rows} rows but sample has {rows}: give the "
                         "targets of the same rows (e.g. sample=x[:n], sample_target=y[:n])")
    return loss_fn, sample_target


_PLAIN = (bool, int, float, str, type(None))


def loss_signature(loss_fn: Any) -> Any:
    """What identifies `loss_fn` across processes: its type (a function's qualified name) and its
    plain settings (``ignore_index``, ``label_smoothing``, ``reduction``, ...), for
    :meth:`~gpipe_repro.engine.placement.Placement.check_same_on_every_rank`."""
    if loss_fn is None:
        return None
    kind = loss_fn if inspect.isroutine(loss_fn) else type(loss_fn)
    name = f"{getattr(kind, '__module__', '')}.{getattr(kind, '__qualname__', repr(kind))}"
    settings = {} if inspect.isroutine(loss_fn) else {
        k: v for k, v in sorted(getattr(loss_fn, "__dict__", {}).items())
        if not k.startswith("_") and isinstance(v, _PLAIN)}
    return [name, settings]


def optimizer_signature(optimizer: torch.optim.Optimizer) -> list[Any]:
    """What identifies an optimizer's rule across processes: its type and its constructor's
    settings (``defaults``: lr, momentum, betas, weight decay, ...), not its parameter groups (a
    factory may group each cell's parameters otherwise)."""
    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            return float(v)
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return v if isinstance(v, _PLAIN) else type(v).__name__
    kind = type(optimizer)
    return [f"{kind.__module__}.{kind.__qualname__}",
            {k: plain(v) for k, v in sorted(getattr(optimizer, "defaults", {}).items())}]


def build_optimizer(factory: Any, cell: nn.Module, stage: int,
                    tied_originals: Mapping[int, nn.Parameter] | None = None) -> torch.optim.Optimizer:
    """``factory(cell's parameters)``, refused before any step where it is not an optimizer of those
    parameters: None (a factory that forgot its ``return``: nothing would ever update), or one
    holding parameters of other cells (built over ``model.parameters()`` rather than the parameters
    given: every cell's optimizer would update them, once per cell). A tied parameter's copy is
    shown to the factory as its original (`tied_originals`: id of a copy -> the original;
    :func:`~gpipe_repro.engine.stand_ins.shown_to_optimizer`), so param groups chosen by identity
    give every copy the original's settings."""
    params = list(cell.parameters())
    optimizer = shown_to_optimizer(factory, params, tied_originals or {})
    if optimizer is None or not callable(getattr(optimizer, "step", None)) \
            or not isinstance(getattr(optimizer, "param_groups", None), list):
        what = "None" if optimizer is None else f"a {type(optimizer).__name__}"
        raise ValueError(f"optimizer returned {what} for cell {stage}, not an "
                         "optimizer: the factory must return one built over the parameters it is "
                         "given, e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.1) (a def "
                         "needs its return); pass optimizer=None to compute gradients without updating")
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        closure = None
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"{type(optimizer).__name__}.step needs a closure that evaluates the loss "
                         "again, which a pipeline's update cannot give (each micro-batch runs one "
                         "forward and backward before it): use an optimizer whose step takes none "
                         "(SGD, Adam, AdamW, ...)")
    mine = {id(p) for p in params}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in mine)
    if foreign:
        raise ValueError(f"the optimizer built for cell {stage} holds {foreign} parameter(s) that are "
                         "not that cell's: build it over the parameters the factory is given "
                         "(optimizer=lambda params: torch.optim.AdamW(params, ...)), not over "
                         "model.parameters(); each cell has its own optimizer")
    return optimizer
