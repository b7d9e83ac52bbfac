"""fp16's dynamic loss scale, by ``torch.amp.GradScaler``'s rule.

The last stage multiplies each micro-batch's loss by :attr:`LossScaler.scale` before its backward;
AGREE divides every gradient by it (:class:`~gpipe_repro.engine.agreement.Agreement`) and decides,
for all stages at once, whether a gradient overflowed. After the step :meth:`LossScaler.update`
halves the scale on an overflow (the step was skipped) and doubles it after ``growth_interval``
clean steps in a row; GradScaler's defaults. Without fp16 the scale stays 1 and never changes.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LossScaler", "saved_scaler", "restore_scaler"]


class LossScaler:
    """The loss scale of one pipeline (see the module docstring).

    Args:
        enabled: False (fp32, bf16): the scale is 1 and :meth:`update` does nothing.
        init_scale, growth_factor, backoff_factor, growth_interval: GradScaler's, with its defaults.
    """

    def __init__(self, enabled: bool, *, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.scale = init_scale if enabled else 1.0
        self.growth_tracker = 0     # clean steps since the scale last changed

    def update(self, skipped: Callable[[], bool]) -> None:
        """After a step: `skipped()` (a gradient overflowed; called only when enabled, as it may read
        the verdict from the device) halves the scale, `growth_interval` clean steps in a row double
        it."""
        if not self.enabled:
            return
        if skipped():
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state.get("scale", self.scale))
        self.growth_tracker = int(state.get("growth_tracker", 0))


def saved_scaler(scaler: LossScaler) -> dict[str, Any]:
    """The scaler's state under ``GPipe.training_state``'s keys; none without fp16 (there is no loss
    scale to resume: an fp32 or bf16 state loaded into an fp16 pipeline keeps that pipeline's)."""
    if not scaler.enabled:
        return {}
    return {"loss_scale": scaler.scale, "growth_tracker": scaler.growth_tracker}


def restore_scaler(scaler: LossScaler, state: dict[str, Any]) -> None:
    """Restore :func:`saved_scaler`'s keys of `state` into an fp16 pipeline's scaler (a state saved
    without them keeps the scale); a scaler that is off stays at 1."""
    if not scaler.enabled:
        return
    scaler.load_state_dict({"scale": state.get("loss_scale", scaler.scale),
                            "growth_tracker": state.get("growth_tracker", 0)})
