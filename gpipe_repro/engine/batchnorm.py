"""BatchNorm under micro-batching: normalize per micro-batch, commit running statistics once per step.

With M micro-batches a plain BatchNorm would update its running statistics M times per step (and
M more times during recomputation), each from a fraction of the batch. `DeferredBatchNorm` instead:

- normalizes each micro-batch with that micro-batch's own statistics (as the paper does);
- keeps each micro-batch's mean and variance (skipping recomputations) and merges them at the
  commit (Chan et al.'s parallel mean/variance, which stays accurate where sum-of-squares would
  cancel);
- commits them once, when the stage takes its optimizer step, so the running mean/var equal those
  of a plain BatchNorm that saw the whole mini-batch in one forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_repro.engine.recompute import is_recomputing

__all__ = ["DeferredBatchNorm", "commit_all"]


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
        rows = input.numel() // input.shape[1]
        native = input.dtype in (torch.float32, torch.float64) and (
            self.weight is None or self.weight.dtype == input.dtype)
        if native and rows > 1:
            mean = torch.zeros(self.num_features, dtype=input.dtype, device=input.device)
            var = torch.zeros(self.num_features, dtype=input.dtype, device=input.device)
            out = F.batch_norm(input, mean, var, self.weight, self.bias, True, 1.0, self.eps)
            self._pending.append((rows, mean, var))
            return out
        x = input.detach()
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x.float(), dim=dims, correction=1 if rows > 1 else 0)
        self._pending.append((rows, mean, var))
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def pending_statistics(self) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """This step's statistics so far, merged: (rows, mean, sum of squared deviations M2), in
        float64; None before the first micro-batch.

        Chan, Golub & LeVeque, "Algorithms for computing the sample variance" (1983), eq. 2.1 over all
        groups at once: M2 = sum_i M2_i + sum_i n_i (mean_i - mean)^2, mean = sum_i n_i mean_i / n."""
        if not self._pending:
            return None
        rows = torch.tensor([n for n, _, _ in self._pending], dtype=torch.float64,
                            device=self._pending[0][1].device)
        means = torch.stack([m for _, m, _ in self._pending]).double()
        variances = torch.stack([v for _, _, v in self._pending]).double()
        total = float(sum(n for n, _, _ in self._pending))   # Python ints: no read from the device
        mean = (rows[:, None] * means).sum(0) / total
        m2 = ((rows[:, None] - 1).clamp(min=0) * variances).sum(0) \
            + (rows[:, None] * (means - mean) ** 2).sum(0)
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
        """Return `module` with every BatchNorm{1,2,3}d replaced by a DeferredBatchNorm (in place for
        children)."""
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
            return new
        for name, child in module.named_children():
            setattr(module, name, cls.convert(child))
        return module


def commit_all(module: nn.Module) -> None:
    """Commit every DeferredBatchNorm inside `module`."""
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            m.commit()
