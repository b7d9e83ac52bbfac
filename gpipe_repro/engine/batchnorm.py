"""BatchNorm under micro-batching: normalize per micro-batch, commit running statistics once per step.

With M micro-batches a plain BatchNorm would update its running statistics M times per step (and
M more times during recomputation), each from a fraction of the batch. `DeferredBatchNorm` instead:

- normalizes each micro-batch with that micro-batch's own statistics (as the paper does);
- merges the statistics of all micro-batches of the step (Chan et al.'s parallel mean/variance,
  which stays accurate where sum-of-squares would cancel), skipping recomputations;
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
        self._count = 0
        self._mean: torch.Tensor | None = None
        self._m2: torch.Tensor | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training or not self.track_running_stats):
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if self.track_running_stats and self.training and not is_recomputing():
            self._accumulate(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _accumulate(self, x: torch.Tensor) -> None:
        dims = [0, *range(2, x.dim())]
        n = x.numel() // x.shape[1]
        var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
        m2 = var * n
        if self._count == 0:
            self._count, self._mean, self._m2 = n, mean, m2
            return
        assert self._mean is not None and self._m2 is not None
        total = self._count + n
        delta = mean - self._mean
        self._mean = self._mean + delta * (n / total)
        self._m2 = self._m2 + m2 + delta * delta * (self._count * n / total)
        self._count = total

    @torch.no_grad()
    def commit(self) -> None:
        """Fold this step's merged statistics into the running ones (once per step)."""
        if self._count == 0 or not self.track_running_stats:
            return
        assert self._mean is not None and self._m2 is not None
        mean_buf, var_buf, tracked = self.running_mean, self.running_var, self.num_batches_tracked
        assert mean_buf is not None and var_buf is not None and tracked is not None
        tracked.add_(1)
        momentum = (1.0 / float(tracked) if self.momentum is None else self.momentum)
        unbiased = self._m2 / max(self._count - 1, 1)
        mean_buf.mul_(1 - momentum).add_(self._mean.to(mean_buf.dtype), alpha=momentum)
        var_buf.mul_(1 - momentum).add_(unbiased.to(var_buf.dtype), alpha=momentum)
        self._count, self._mean, self._m2 = 0, None, None

    def discard(self) -> None:
        """Drop statistics accumulated but not committed (a step that failed before its update)."""
        self._count, self._mean, self._m2 = 0, None, None

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
