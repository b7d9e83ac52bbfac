"""BatchNorm under micro-batching: normalize per micro-batch, commit running statistics once per step.

With M micro-batches a plain BatchNorm would update its running statistics M times per step (and
M more times during recomputation), each from a fraction of the batch. `DeferredBatchNorm` instead:

- normalizes each micro-batch with that micro-batch's own statistics (as the paper does);
- keeps each micro-batch's mean and variance (skipping recomputations) and merges them at the
  commit (Chan et al.'s parallel mean/variance, which stays accurate where sum-of-squares would
  cancel);
- commits them once, when the stage takes its optimizer step, so the running mean/var equal those
  of a plain BatchNorm that saw the whole mini-batch in one forward.

A stage commits all its BatchNorms at once (:func:`commit_many`): the merge and the update of every
layer's running statistics run as a handful of kernels over all their features together, not some
twenty per layer. On an AmoebaNet cell of a hundred-odd BatchNorms at 4-image micro-batches the
per-layer commit cost about a sixth of the step.

A BatchNorm without running statistics normalizes by its batch in eval mode too: inference runs
such a model's batch as one micro-batch (:class:`BatchStatisticsInEval`).
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_repro.engine.recompute import is_recomputing

__all__ = ["DeferredBatchNorm", "check_batchnorms", "commit_all", "commit_many", "is_one_value_per_channel"]


def is_one_value_per_channel(error: BaseException | str) -> bool:
    """Whether `error` is PyTorch's refusal of batch statistics over one value per channel (a
    BatchNorm training on a micro-batch of one row, or after global pooling on one example)."""
    return "Expected more than 1 value per channel when training" in " ".join(str(error).split())


#: A module's hook registries that a stand-in shares with the module it stands in for.
_FORWARD_AND_BACKWARD_HOOKS = tuple(k for k in nn.Module().__dict__ if "hook" in k and "state_dict" not in k)


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm whose running statistics are committed once per mini-batch (see module doc)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        # This step's statistics, one entry per micro-batch: (rows, mean, unbiased variance).
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training or not self.track_running_stats):
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if self.track_running_stats and self.training and not is_recomputing():
            return self._normalize_and_record(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _normalize_and_record(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize with the micro-batch's statistics and keep them for the step's commit.

        In float32/float64 the statistics come out of the normalization itself: `F.batch_norm` with
        fresh buffers and momentum 1 leaves exactly the batch mean and unbiased variance in them (one
        kernel instead of a second pass over the activations; at 8-row micro-batches the second pass
        cost ~15% of an AmoebaNet step). Other dtypes (mixed precision) take a separate float32
        pass, as the normalization's own buffers would be in the input's precision."""
        weight, features, dtype = self.weight, input.shape[1], input.dtype
        rows = input.numel() // features
        if rows > 1 and (dtype is torch.float32 or dtype is torch.float64) and (
                weight is None or weight.dtype is dtype):
            # F.batch_norm's own checks (more than one value per channel) hold: its kernel directly,
            # a few microseconds less per call, which micro-batches of a few images feel
            mean, var = input.new_zeros(features), input.new_zeros(features)
            out = torch.batch_norm(input, weight, self.bias, mean, var, True, 1.0, self.eps,
                                   torch.backends.cudnn.enabled)
            self._record(rows, mean, var)
            return out
        x = input.detach()
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x.float(), dim=dims, correction=1 if rows > 1 else 0)
        self._record(rows, mean, var)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _record(self, rows: int, mean: torch.Tensor, var: torch.Tensor) -> None:
        if torch.compiler.is_compiling():   # a compiled layer (GPipe(compile=...)): see _record_eagerly
            _record_eagerly(self._pending, rows, mean, var)
        else:
            self._pending.append((rows, mean, var))

    def pending_statistics(self) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """This step's statistics so far, merged: (rows, mean, sum of squared deviations M2), in
        float64; None before the first micro-batch.

        Chan, Golub & LeVeque, "Algorithms for computing the sample variance" (1983), eq. 2.1 over all
        groups at once: M2 = sum_i M2_i + sum_i n_i (mean_i - mean)^2, mean = sum_i n_i mean_i / n."""
        if not self._pending:
            return None
        rows = _host_numbers([n for n, _, _ in self._pending], torch.float64, self._pending[0][1].device)
        means = torch.stack([m for _, m, _ in self._pending]).double()
        variances = torch.stack([v for _, _, v in self._pending]).double()
        total = float(sum(n for n, _, _ in self._pending))   # Python ints: no read from the device
        mean, m2 = _chan_merge(rows[:, None], means, variances, total)
        return int(total), mean, m2

    def replace_pending_statistics(self, rows: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Replace this step's statistics by already merged ones (rows, mean, M2): what synchronized
        BatchNorm over data-parallel replicas commits."""
        unbiased = m2 / max(rows - 1, 1)
        self._pending = [(rows, mean, unbiased)] if rows > 0 else []

    @torch.no_grad()
    def commit(self) -> None:
        """Fold this step's merged statistics into the running ones (once per step)."""
        merged = self.pending_statistics()
        if merged is None or not self.track_running_stats:
            self._pending = []
            return
        rows, mean, m2 = merged
        mean_buf, var_buf, tracked = self.running_mean, self.running_var, self.num_batches_tracked
        assert mean_buf is not None and var_buf is not None and tracked is not None
        tracked.add_(1)
        momentum = (1.0 / float(tracked) if self.momentum is None else self.momentum)
        unbiased = m2 / max(rows - 1, 1)
        mean_buf.mul_(1 - momentum).add_(mean.to(mean_buf.dtype), alpha=momentum)
        var_buf.mul_(1 - momentum).add_(unbiased.to(var_buf.dtype), alpha=momentum)
        self._pending = []

    def discard(self) -> None:
        """Drop statistics accumulated but not committed (a step that failed before its update)."""
        self._pending = []

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """`module` with every BatchNorm{1,2,3}d replaced by a DeferredBatchNorm holding the same
        parameters and running statistics. `module` itself is left as it is: a module with a BatchNorm
        inside comes back as a shallow copy whose children are the same modules but for the
        replaced ones (so the caller's model still runs as a plain BatchNorm model, and what the
        pipeline trains and commits lands in its tensors). A DeferredBatchNorm runs the BatchNorm's
        own forward and backward hooks, those registered later included."""
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
                module, (cls, nn.SyncBatchNorm)):
            new = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats)
            if module.affine:
                new.weight, new.bias = module.weight, module.bias
            if module.track_running_stats:
                new.running_mean, new.running_var = module.running_mean, module.running_var
                new.num_batches_tracked = module.num_batches_tracked
            new.train(module.training)
            # its hooks are the BatchNorm's (the same dictionaries: one registered later runs too)
            for key in _FORWARD_AND_BACKWARD_HOOKS:
                if key in module.__dict__:
                    new.__dict__[key] = module.__dict__[key]
            return new
        children = {name: cls.convert(child) for name, child in module.named_children()}
        if all(children[name] is child for name, child in module.named_children()):
            return module
        converted = copy.copy(module)
        converted._modules = dict(module._modules)
        converted._modules.update(children)
        return converted


def check_batchnorms(layers: Sequence[nn.Module]) -> None:
    """Refuse, before any work, a BatchNorm that :meth:`DeferredBatchNorm.convert` cannot stand in for
    exactly: one module used at two places (plain training updates its running statistics once per
    use, in order; one deferred commit per step cannot), a subclass with a ``forward`` of its own
    (the replacement would drop it), and ``nn.SyncBatchNorm`` (it reduces over processes inside its
    forward, which the pipeline runs per micro-batch and again per recompute); two BatchNorms that
    share a running statistic (the same tensor) are refused as one module used twice is."""
    seen: dict[int, str] = {}
    stats: dict[int, tuple[str, str]] = {}    # each running statistic's BatchNorm, and which it is
    for i, layer in enumerate(layers):
        for name, mod in layer.named_modules(remove_duplicate=False):
            if not isinstance(mod, nn.modules.batchnorm._BatchNorm):
                continue
            where = f"layer {i} (" + (f"{name}: " if name else "") + f"{type(mod).__name__})"
            if isinstance(mod, nn.SyncBatchNorm):
                raise ValueError(
                    f"{where} is an nn.SyncBatchNorm, which reduces its statistics over processes "
                    "inside each forward (per micro-batch, and again per recompute in a pipeline). Use "
                    "a plain BatchNorm: GPipe commits its statistics once per step from the whole "
                    "mini-batch, and with replicas batchnorm_stats='synchronized' merges them over the "
                    "replicas (nn.SyncBatchNorm has the same parameters and buffers)")
            if not isinstance(mod, DeferredBatchNorm) and (
                    type(mod).forward is not nn.modules.batchnorm._BatchNorm.forward):
                raise ValueError(
                    f"{where} subclasses a BatchNorm with a forward of its own; GPipe replaces "
                    "BatchNorms by DeferredBatchNorm (one statistics update per step) and would drop "
                    "that forward. Move the extra computation into a module of its own around a plain "
                    "BatchNorm, or pass deferred_batchnorm=False (the BatchNorm then updates its "
                    "statistics once per micro-batch and recompute)")
            if mod.track_running_stats and id(mod) in seen:
                raise ValueError(
                    f"{where} is the same BatchNorm module as {seen[id(mod)]}: plain training updates "
                    "its running statistics once per use, in order, and a pipeline's one deferred "
                    "update per step cannot. Give each use its own BatchNorm (to share the affine "
                    "weights, set the second's weight and bias to the first's), or "
                    "track_running_stats=False")
            seen[id(mod)] = where
            if not mod.track_running_stats:
                continue
            for stat in ("running_mean", "running_var", "num_batches_tracked"):
                buffer = getattr(mod, stat, None)
                if buffer is None:
                    continue
                if id(buffer) in stats and stats[id(buffer)][0] != where:
                    raise ValueError(
                        f"{where} shares its {stat} with {stats[id(buffer)][0]} (the same tensor): plain "
                        "training updates shared running statistics once per use, in order, and a "
                        "pipeline's one deferred update per BatchNorm per step cannot. Give each "
                        "BatchNorm statistics of its own (to share the affine weights, set the "
                        "second's weight and bias to the first's), or track_running_stats=False")
                stats[id(buffer)] = (where, stat)


@torch.compiler.disable
def _record_eagerly(pending: list[tuple[int, torch.Tensor, torch.Tensor]], rows: int, mean: torch.Tensor,
                    var: torch.Tensor) -> None:
    """Keep a micro-batch's statistics outside the compiled graph: traced, the append would make
    Dynamo guard on the list's length and compile the layer again for every micro-batch."""
    pending.append((rows, mean, var))


class BatchStatisticsInEval:
    """Inference with a BatchNorm that normalizes by its batch: one without running statistics (it
    does so in eval mode too), or one left in training mode (adapting at test time) in a pipeline
    that infers. Per micro-batch the output would depend on M; such a batch goes through whole, as
    plain eval would (one warning), and the training one's running statistics take the batch once.
    Whether one has running statistics is read from every layer once (every process of a
    distributed pipeline knows it alike); whether one is in training mode, at each call, by the
    caller (``model.eval()``, ``pipe.eval()`` or one layer's ``train()``; a distributed pipeline's
    processes agree on it first).

    Args:
        layers: the model's layers.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.culprit = next((f"layer {i} ({type(mod).__name__}) has no running statistics"
                             for i, layer in enumerate(layers) for mod in layer.modules()
                             if isinstance(mod, nn.modules.batchnorm._BatchNorm)
                             and not mod.track_running_stats), None)
        self.warned = False

    @staticmethod
    def adapting(modules: Iterable[nn.Module]) -> bool:
        """Whether a BatchNorm among `modules` is in training mode now (normalizing by its batch)."""
        return any(isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training for mod in modules)

    def microbatches(self, m: int, adapting: bool = False) -> int:
        """How many micro-batches an inference batch asked to run as `m` runs as (`adapting`: a
        BatchNorm of the model is in training mode now)."""
        if m == 1:
            return m
        culprit = self.culprit or ("a BatchNorm is in training mode" if adapting else None)
        if culprit is None:
            return m
        if not self.warned:
            self.warned = True
            warnings.warn(f"{culprit}, so it normalizes by the batch in inference: pipe(x) runs the "
                          "batch as one micro-batch, as plain eval would (a BatchNorm in eval mode "
                          "with running statistics pipelines inference)", stacklevel=4)
        return 1


def commit_all(module: nn.Module) -> None:
    """Commit every DeferredBatchNorm inside `module`."""
    commit_many([m for m in module.modules() if isinstance(m, DeferredBatchNorm)])


def commit_many(bns: Sequence[DeferredBatchNorm]) -> None:
    """:meth:`DeferredBatchNorm.commit` for each of `bns`, the same arithmetic (Chan's merge in
    float64, then ``running = (1 - momentum) * running + momentum * merged``), batched: layers whose
    statistics share a device and dtypes, a momentum and a number of micro-batches are merged and
    updated together, concatenated along their features. The rest (a cumulative ``momentum=None``, no
    running statistics, nothing pending) commit one by one."""
    groups: dict[tuple[object, ...], list[DeferredBatchNorm]] = {}
    for bn in bns:
        if (not bn._pending or not bn.track_running_stats or bn.momentum is None
                or bn.running_mean is None or bn.running_var is None or bn.num_batches_tracked is None):
            bn.commit()
            continue
        key = (bn.running_mean.device, bn.running_mean.dtype, bn._pending[0][1].dtype, float(bn.momentum),
               len(bn._pending))
        groups.setdefault(key, []).append(bn)
    for group in groups.values():
        if len(group) == 1:
            group[0].commit()
        else:
            _commit_together(group)


def _chan_merge(rows: torch.Tensor, means: torch.Tensor, variances: torch.Tensor,
                total: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, M2) of groups given by their rows, means and unbiased variances (one group per row of
    `means`; `rows` broadcasts against it; `total` the summed rows), float64: Chan, Golub & LeVeque
    (1983), eq. 2.1 over all groups at once (see :meth:`DeferredBatchNorm.pending_statistics`)."""
    mean = (rows * means).sum(0) / total
    m2 = ((rows - 1).clamp(min=0) * variances).sum(0) + (rows * (means - mean) ** 2).sum(0)
    return mean, m2


def _host_numbers(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Python numbers as a tensor on `device`; to a GPU through pinned memory and without waiting
    (a copy from pageable memory would wait for the GPU's queued work: a host sync each step)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@torch.no_grad()
def _commit_together(group: list[DeferredBatchNorm]) -> None:
    """The merged commit of layers of one :func:`commit_many` group, features side by side."""
    steps = len(group[0]._pending)
    device = group[0]._pending[0][1].device
    sizes = [bn.num_features for bn in group]
    rows_per = [[bn._pending[i][0] for bn in group] for i in range(steps)]
    means = torch.stack([torch.cat([bn._pending[i][1] for bn in group]) for i in range(steps)]).double()
    variances = torch.stack([torch.cat([bn._pending[i][2] for bn in group]) for i in range(steps)]).double()
    counts, width = _host_numbers(sizes, torch.int64, device), sum(sizes)
    rows = _host_numbers(rows_per, torch.float64, device).repeat_interleave(counts, dim=1, output_size=width)
    totals = [float(sum(r[j] for r in rows_per)) for j in range(len(group))]
    total = _host_numbers(totals, torch.float64, device).repeat_interleave(counts, output_size=width)
    mean, m2 = _chan_merge(rows, means, variances, total)
    unbiased = m2 / (total - 1).clamp(min=1)
    dtype = group[0].running_mean.dtype            # type: ignore[union-attr]
    momentum = float(group[0].momentum)            # type: ignore[arg-type]
    running_means = [bn.running_mean for bn in group]
    running_vars = [bn.running_var for bn in group]
    torch._foreach_add_([bn.num_batches_tracked for bn in group], 1)  # type: ignore[misc]
    torch._foreach_mul_(running_means, 1 - momentum)                  # type: ignore[arg-type]
    torch._foreach_add_(running_means, list(mean.to(dtype).split(sizes)), alpha=momentum)  # type: ignore[arg-type]
    torch._foreach_mul_(running_vars, 1 - momentum)                   # type: ignore[arg-type]
    torch._foreach_add_(running_vars, list(unbiased.to(dtype).split(sizes)), alpha=momentum)  # type: ignore[arg-type]
    for bn in group:
        bn._pending = []
