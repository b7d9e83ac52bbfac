"""Optimizers, learning-rate schedules and label-smoothed losses for the training runs.

Why these pieces and not torch's ready-made ones:

- **One optimizer per cell.** GPipe builds an optimizer for each cell from a factory
  (`params -> Optimizer`), so everything here is a factory. Weight decay skips biases and
  BatchNorm/LayerNorm parameters (every parameter with fewer than 2 dimensions), as the reference
  AmoebaNet and Transformer code do; the split is per parameter, so it does not depend on K.
- **One schedule for K optimizers.** The learning rate is a pure function of the step
  (:class:`ScheduledLR` writes it into every param group of every cell's optimizer before the step).
  A resumed run therefore gets the same rate from the step alone, and K=1 and K=4 agree exactly.
  torch's `LRScheduler` would need K copies kept in sync.
- **TensorFlow's RMSProp.** The AmoebaNet recipe (decay 0.9, momentum 0.9, epsilon 1.0) comes from
  TensorFlow code, whose RMSProp differs from `torch.optim.RMSprop` in three ways that matter at
  epsilon 1.0: the mean square starts at 1 (not 0), epsilon is added *inside* the square root, and
  the learning rate multiplies the gradient *before* the momentum accumulator.
  :class:`RMSpropTF` implements that update:

      ms  <- decay * ms + (1 - decay) * g^2            (ms starts at 1)
      mom <- momentum * mom + lr * g / sqrt(ms + eps)
      w   <- w - mom

Schedules (all `step -> lr`, step counted from 0, warm-up linear from lr/warmup to lr):
`constant`, `exponential` (the AmoebaNet recipe: warm-up, then lr * rate^floor((step - warmup) /
decay_steps)), `inverse_sqrt` (the Transformer's: warm-up, then lr * sqrt(warmup / step)) and `cosine`
(warm-up, then half a cosine to 0; handy for short fine-tuning runs).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LRFunction = Callable[[int], float]

OPTIMIZERS = ("rmsprop", "rmsprop-torch", "sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "exponential", "inverse_sqrt", "cosine")


# ----------------------------------------------------------------------------- the optimizer

class RMSpropTF(torch.optim.Optimizer):
    """RMSProp as TensorFlow computes it (see the module docstring); `weight_decay` adds
    `weight_decay * w` to the gradient (the gradient of TF's `weight_decay * l2_loss(w)`)."""

    def __init__(self, params: Iterable[Any], lr: float, decay: float = 0.9, momentum: float = 0.9,
                 eps: float = 1.0, weight_decay: float = 0.0) -> None:
        if lr < 0 or not 0.0 <= decay < 1.0 or momentum < 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"invalid RMSpropTF settings: lr={lr}, decay={decay}, momentum={momentum}, "
                             f"eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "decay": decay, "momentum": momentum, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        # (torch's stub declares two overloads; one signature with an optional closure is what it runs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay, momentum = group["lr"], group["decay"], group["momentum"]
            eps, weight_decay = group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if weight_decay == 0 else p.grad.add(p, alpha=weight_decay)
                state = self.state[p]
                if not state:
                    state["mean_square"] = torch.ones_like(p)
                    state["momentum"] = torch.zeros_like(p)
                ms, mom = state["mean_square"], state["momentum"]
                ms.mul_(decay).addcmul_(grad, grad, value=1.0 - decay)
                mom.mul_(momentum).addcdiv_(grad, (ms + eps).sqrt_(), value=lr)
                p.sub_(mom)
        return loss


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Which optimizer and learning-rate schedule a run uses (all plain values: it goes into the
    run config, W&B and checkpoints)."""

    name: str = "rmsprop"
    lr: float = 0.015
    weight_decay: float = 0.0
    momentum: float = 0.9
    rmsprop_decay: float = 0.9
    eps: float = 1.0                   # RMSProp epsilon; Adam uses adam_eps
    betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    schedule: str = "constant"
    warmup_steps: int = 0
    decay_rate: float = 0.97           # exponential: factor per decay_steps
    decay_steps: int = 1
    total_steps: int = 0               # cosine: where the rate reaches 0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}: use one of {OPTIMIZERS}")
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.schedule!r}: use one of {LR_SCHEDULES}")
        if self.lr <= 0:
            raise ValueError(f"the learning rate must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise ValueError(f"warmup_steps must be >= 0 and decay_steps >= 1, got {self.warmup_steps} "
                             f"and {self.decay_steps}")
        if self.schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"a cosine schedule needs total_steps ({self.total_steps}) > warmup_steps "
                             f"({self.warmup_steps})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> OptimizerConfig:
        """A copy with `changes` (None values are ignored: "not overridden")."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def parameter_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weights (decayed) and biases / normalization parameters (ndim < 2, not decayed)."""
    params = [p for p in params if p.requires_grad]
    decayed = [p for p in params if p.ndim >= 2]
    plain = [p for p in params if p.ndim < 2]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def optimizer_factory(config: OptimizerConfig) -> OptimizerFactory:
    """`params -> Optimizer` for `GPipe(optimizer=...)`; one is built per cell."""

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        groups = parameter_groups(params, config.weight_decay)
        if config.name == "rmsprop":
            return RMSpropTF(groups, lr=config.lr, decay=config.rmsprop_decay,
                             momentum=config.momentum, eps=config.eps)
        if config.name == "rmsprop-torch":
            return torch.optim.RMSprop(groups, lr=config.lr, alpha=config.rmsprop_decay,
                                       momentum=config.momentum, eps=config.eps)
        if config.name == "sgd":
            return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
        if config.name == "adam":
            return torch.optim.Adam(groups, lr=config.lr, betas=config.betas, eps=config.adam_eps)
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.adam_eps)

    return build


# ----------------------------------------------------------------------------- schedules

def warmup_factor(step: int, warmup_steps: int) -> float:
    """(step + 1) / warmup during warm-up, else 1: the first update already moves the weights."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def lr_function(config: OptimizerConfig) -> LRFunction:
    """The schedule of `config` as `step -> learning rate`."""
    base, warmup = config.lr, config.warmup_steps

    if config.schedule == "constant":
        return lambda step: base * warmup_factor(step, warmup)
    if config.schedule == "exponential":
        def exponential(step: int) -> float:
            if step < warmup:
                return base * warmup_factor(step, warmup)
            return base * config.decay_rate ** ((step - warmup) // config.decay_steps)
        return exponential
    if config.schedule == "inverse_sqrt":
        def inverse_sqrt(step: int) -> float:
            if step < warmup:
                return base * warmup_factor(step, warmup)
            return base * math.sqrt(max(warmup, 1) / (step + 1))
        return inverse_sqrt

    def cosine(step: int) -> float:
        if step < warmup:
            return base * warmup_factor(step, warmup)
        progress = min(1.0, (step - warmup) / (config.total_steps - warmup))
        return base * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cosine


class ScheduledLR:
    """Sets every param group of every cell's optimizer to `fn(step)`.

    Stateless apart from the last step applied (kept in `state_dict` so a checkpoint records it);
    the rate itself is recomputed from the step, so resuming cannot drift.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer | None], fn: LRFunction) -> None:
        self.optimizers = [o for o in optimizers if o is not None]
        self.fn = fn
        self.last_step = -1
        self.last_lr = float("nan")

    def apply(self, step: int) -> float:
        lr = float(self.fn(step))
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        self.last_step, self.last_lr = step, lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "last_lr": self.last_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state["last_step"])
        if self.last_step >= 0:
            self.apply(self.last_step)


# ----------------------------------------------------------------------------- losses

def smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, smoothing: float = 0.0,
                           ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy against (1 - smoothing) one-hot + smoothing / classes (Szegedy et al. 2016).

    Logits of any shape (..., classes) with targets (...); `ignore_index` positions (padding) add
    nothing. For a token-level mean over a mini-batch that GPipe splits into micro-batches, use
    `reduction="sum"` with `GPipe(loss_reduction="sum")` and divide by the batch's token count.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {smoothing}")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing)


def topk_correct(logits: torch.Tensor, target: torch.Tensor, ks: Sequence[int] = (1, 5)
                 ) -> dict[int, int]:
    """How many targets are among the k highest logits, for each k (k is capped at the classes)."""
    top = logits.topk(min(max(ks), logits.shape[-1]), dim=-1).indices
    hits = top == target.unsqueeze(-1)
    return {k: int(hits[:, :min(k, top.shape[-1])].any(dim=-1).sum()) for k in ks}
