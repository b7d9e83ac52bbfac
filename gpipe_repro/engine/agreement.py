"""What every stage must know the same way to take a step, and what the stages agree on at AGREE.

- :class:`StepConfig`: precision, global clipping, the fp16 loss scale: the same on every stage;
- :class:`Contribution`: what one stage brings to AGREE (its loss and count on the last stage, its
  squared gradient norm and non-finite flag, :func:`stage_contribution`), a float64 vector on the
  stage's device read by name; the transport returns their sum over all stages (a sum on one device
  in one process, one all-reduce of :attr:`Contribution.vector` between processes);
- :class:`Agreement`: derived from that sum, the same on every stage: the reported loss, the global
  gradient norm, the factor every gradient is multiplied by (1/count, 1/loss scale, the clipping
  coefficient) and whether to skip the update (fp16 overflow).

**Host reads.** All of it is computed with tensor operations on the device, so a step does not wait
for the device (``float(t)``, ``t.item()``, ``bool(t)``) except where the host must decide:

- fp16: whether to skip the update (an overflow) is read once per step: the optimizers' ``step()``
  is Python and must either run or not, and the loss scale's next value depends on it;
- a ``(sum, count)`` loss: its total count is read once per step, to refuse a count <= 0 before
  any update (1/count would turn every gradient into inf). With fp16 both are read together, once.

Everything else (the loss, the global gradient norm) stays a 0-dim tensor until the caller asks
for a number (:func:`host_value`; ``GPipe.train_step(..., sync=False)``). Outside the agreement:
a ``BatchNorm(momentum=None)`` (a cumulative average) reads its step count once per step; the
distributed runtime agrees over a CPU (gloo) group, so on a GPU its contribution's copy to the CPU
waits for the step's kernels (as its end of step does, to time the step); an optimizer may read its
own state (Adam's step count, a CPU tensor unless ``capturable``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from gpipe_repro.engine.traced import has_values

__all__ = ["AGREEMENT_FIELDS", "StepConfig", "Contribution", "Agreement", "stage_contribution",
           "host_value"]

# The order of a Contribution's numbers in its vector (what an all-reduce carries).
AGREEMENT_FIELDS = ("loss", "count", "weighted", "grad_sq_norm", "nonfinite")


@dataclass(frozen=True)
class StepConfig:
    """What every stage must know the same way to take a step.

    Args:
        precision: "fp32", "bf16" or "fp16": autocast dtype of each cell's forward (and loss);
            parameters and optimizer states stay fp32; boundary values cross as computed.
        clip_grad_norm: the max global L2 norm of all gradients (all cells), or None: no clipping.
        loss_scale: fp16 only: the loss is multiplied by it before backward; gradients are divided.
        count_scale: fp16 with a ``(sum, count)`` loss: its summed loss is divided by this too (the
            count the loss will give, known before the step, the same on every stage:
            :func:`~gpipe_repro.engine.microbatch.target_count`), so that
            the loss scale applies to about a mean, as ``torch.amp.GradScaler``'s to a mean loss
            (times the count, the scale overflowed log2(tokens) halvings early: every step of a
            run skipped until it came down); gradients are multiplied back.
        low_precision_boundaries: under bf16/fp16, floating boundary values cross in that dtype
            (half the bytes sent and kept), not as computed.
    """
    precision: str = "fp32"
    clip_grad_norm: float | None = None
    loss_scale: float = 1.0
    count_scale: float = 1.0
    low_precision_boundaries: bool = False

    def backward_scale(self, counted: bool) -> float:
        """What a micro-batch's weighted loss is multiplied by before its backward (1 unless fp16)."""
        if self.precision != "fp16":
            return 1.0
        return self.loss_scale / self.count_scale if counted else self.loss_scale

    @property
    def needs_norm(self) -> bool:
        return self.clip_grad_norm is not None or self.precision == "fp16"


class Contribution:
    """One stage's numbers at AGREE, or their sum over stages: a float64 vector, one entry per name of
    :data:`AGREEMENT_FIELDS`, read as attributes:

    - ``loss``: the last stage's summed (weighted) micro-batch losses; 0 elsewhere;
    - ``count``: the summed counts of a ``(sum, count)`` loss; ``weighted``: 1 when the loss has counts;
    - ``grad_sq_norm``: the squared L2 norm of the stage's gradients (when clipping or fp16 need it);
    - ``nonfinite``: 1 when that norm is not finite.

    A contribution made by :meth:`of` keeps its numbers by name and builds :attr:`vector` only when
    asked (an all-reduce carries it); one process adds such contributions name by name, so a step
    that needs only the loss launches no kernel for the numbers it does not have.

    Args:
        vector: the numbers, in :data:`AGREEMENT_FIELDS` order.
        counted: whether the loss has counts, when the host knows it (the stage that ran the loss,
            and a sum in one process); None: read it from the vector when needed.
    """

    def __init__(self, vector: torch.Tensor, counted: bool | None = None) -> None:
        self._vector: torch.Tensor | None = vector
        self.device = vector.device
        self.counted = counted
        # by name: 0-dim float64 tensors on `device`; a name that is missing is 0 (kept by `of`)
        self._fields: dict[str, torch.Tensor] | None = None
        self._agreements: dict[StepConfig, Agreement] = {}

    @classmethod
    def _named(cls, device: torch.device, fields: dict[str, torch.Tensor],
               counted: bool | None) -> Contribution:
        out = cls.__new__(cls)
        out._vector, out.device, out.counted, out._fields = None, device, counted, fields
        out._agreements = {}
        return out

    @staticmethod
    def of(device: torch.device, *, loss: torch.Tensor | None = None, count: torch.Tensor | None = None,
           grad_sq_norm: torch.Tensor | None = None, nonfinite: torch.Tensor | None = None) -> Contribution:
        """A contribution on `device` from named 0-dim tensors (missing ones are 0)."""
        named = {"loss": loss, "count": count,
                 "weighted": None if count is None else torch.ones((), dtype=torch.float64, device=device),
                 "grad_sq_norm": grad_sq_norm, "nonfinite": nonfinite}
        fields = {name: value.to(device, torch.float64) for name, value in named.items()
                  if value is not None}
        return Contribution._named(device, fields, counted=count is not None)

    @property
    def vector(self) -> torch.Tensor:
        """The numbers in :data:`AGREEMENT_FIELDS` order, one float64 vector on :attr:`device`."""
        if self._vector is None:
            self._vector = torch.stack([self.field(name) for name in AGREEMENT_FIELDS])
        return self._vector

    def field(self, name: str) -> torch.Tensor:
        """The number called `name` (one of :data:`AGREEMENT_FIELDS`), a 0-dim tensor."""
        if self._fields is None:
            return self.vector[AGREEMENT_FIELDS.index(name)]
        value = self._fields.get(name)
        if value is None:
            if name not in AGREEMENT_FIELDS:
                raise ValueError(f"{name!r} is not one of {AGREEMENT_FIELDS}")
            value = self._fields[name] = torch.zeros((), dtype=torch.float64, device=self.device)
        return value

    @property
    def loss(self) -> torch.Tensor:
        return self.field("loss")

    @property
    def count(self) -> torch.Tensor:
        return self.field("count")

    @property
    def weighted(self) -> torch.Tensor:
        return self.field("weighted")

    @property
    def grad_sq_norm(self) -> torch.Tensor:
        return self.field("grad_sq_norm")

    @property
    def nonfinite(self) -> torch.Tensor:
        return self.field("nonfinite")

    def __add__(self, other: Contribution) -> Contribution:
        counted = None if self.counted is None or other.counted is None else self.counted or other.counted
        if self._fields is None or other._fields is None:
            return Contribution(self.vector + other.vector.to(self.device), counted)
        fields = dict(self._fields)
        for name, value in other._fields.items():
            value = value.to(self.device)
            fields[name] = fields[name] + value if name in fields else value
        return Contribution._named(self.device, fields, counted)

    def without_norm(self) -> Contribution:
        """The same numbers with ``grad_sq_norm`` 0 (a replica whose norm another one counts)."""
        keep = torch.tensor([name != "grad_sq_norm" for name in AGREEMENT_FIELDS], device=self.device)
        return Contribution(torch.where(keep, self.vector, torch.zeros_like(self.vector)), self.counted)

    @staticmethod
    def total(parts: Iterable[Contribution]) -> Contribution:
        """The sum of `parts`, added in their order, on the first one's device."""
        it = iter(parts)
        out = next(it)
        for part in it:
            out = out + part
        return out

    def agreement(self, config: StepConfig) -> Agreement:
        """:meth:`Agreement.from_sum` of this sum, computed once per config: the stages of one
        process that read the same sum share one agreement, so its host reads happen once."""
        if config not in self._agreements:
            self._agreements[config] = Agreement.from_sum(self, config)
        return self._agreements[config]


def stage_contribution(device: torch.device, loss_sum: torch.Tensor | None, count_sum: torch.Tensor | None,
                       grads: Sequence[torch.Tensor] | None) -> Contribution:
    """A stage's :class:`Contribution` on `device`: `loss_sum` and `count_sum` (the last stage's; None
    elsewhere, or no count), and `grads` (None: the step needs no gradient norm)."""
    sq_norm = nonfinite = None
    if grads:
        norms = torch._foreach_norm(list(grads))
        sq_norm = torch.stack([n.double() for n in norms]).square().sum()
        nonfinite = (~torch.isfinite(sq_norm)).double()
    return Contribution.of(device, loss=None if loss_sum is None else loss_sum.detach(), count=count_sum,
                           grad_sq_norm=sq_norm, nonfinite=nonfinite)


def host_value(t: torch.Tensor) -> float:
    """A 0-dim tensor's value as a Python number (a host read: waits for the device); NaN without
    data (fake or meta tensors: the memory planner's)."""
    return float(t) if has_values(t) else math.nan


class Agreement:
    """What all stages agreed on at AGREE (the same on every stage), as 0-dim float64 tensors on the
    device of the sum; see the module docstring for what is read on the host.

    Attributes:
        loss: the mini-batch loss as reported (mean, sum, or sum/count for ``(sum, count)`` losses).
        grad_norm: the global L2 norm of the gradients of the loss, all cells, before clipping
            (None when neither clipping nor fp16 asked for it).
        factor: what every gradient is multiplied by before the update; None: 1 (known on the host).
        skip: fp16: 1 when a gradient overflowed (no cell updates, the loss scale drops); else None.
    """

    def __init__(self, loss: torch.Tensor, grad_norm: torch.Tensor | None, factor: torch.Tensor | None,
                 skip: torch.Tensor | None, skipped: bool | None = None) -> None:
        self.loss, self.grad_norm, self.factor, self.skip = loss, grad_norm, factor, skip
        self._skipped = skipped
        self._factors: dict[torch.device, torch.Tensor] = {}

    def skipped(self) -> bool:
        """Whether the update is skipped (fp16 overflow); False without a read when not fp16."""
        if self._skipped is None:
            self._skipped = self.skip is not None and host_value(self.skip) > 0
        return self._skipped

    def factor_on(self, device: torch.device) -> torch.Tensor | None:
        """:attr:`factor` on `device` (copied once per device; no host read)."""
        if self.factor is None:
            return None
        if device not in self._factors:
            self._factors[device] = self.factor.to(device)
        return self._factors[device]

    @staticmethod
    def from_sum(total: Contribution, config: StepConfig) -> Agreement:
        """Derive the agreement from the stages' summed contributions (see the module docstring)."""
        loss = total.loss
        fp16 = config.precision == "fp16"
        counted = total.counted
        if counted is None:
            counted = host_value(total.weighted) > 0
        factor: torch.Tensor | None = None
        skip = skipped = None
        sq_norm = total.grad_sq_norm if fp16 or config.needs_norm else None
        if fp16:
            assert sq_norm is not None
            skip = ((total.nonfinite > 0) | ~torch.isfinite(sq_norm)).double()
        if counted:
            count = total.count
            if skip is not None and has_values(count):   # fp16: one read for both
                count_value, skip_value = torch.stack([count, skip]).tolist()
                skipped = skip_value > 0
            else:
                count_value = host_value(count)
            if count_value <= 0:
                raise ValueError(f"the loss's counts add up to {count_value:g} over the mini-batch: a "
                                 "(sum, count) loss needs a positive total count (e.g. at least one "
                                 "non-padding token)")
            factor, loss = 1.0 / count, loss / count
        if fp16:
            factor = (torch.ones_like(loss) if factor is None else factor) / config.backward_scale(counted)
        norm = None
        if config.needs_norm:
            assert sq_norm is not None
            scale = 1.0 if factor is None else factor
            norm = sq_norm.sqrt() * scale          # nan or inf where a gradient is, as torch's
        if config.clip_grad_norm is not None:
            assert norm is not None
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1,
            # NaN kept (a NaN norm makes every gradient NaN; not applied to a skipped step: its
            # factor is never used).
            coef = config.clip_grad_norm / (norm + 1e-6)
            clip = (coef < 1.0) | coef.isnan()
            if skip is not None:
                clip = clip & (skip == 0)
            base = torch.ones_like(loss) if factor is None else factor
            factor = torch.where(clip, base * coef, base)
        return Agreement(loss, norm, factor, skip, skipped)
