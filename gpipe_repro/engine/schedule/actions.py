"""The schedule's vocabulary: action kinds, actions, the kind sets, and :class:`ScheduleError`.

An :class:`Action` is one step of one stage (``F3``: forward of micro-batch 3); its short names are
the text form's tokens (:mod:`gpipe_repro.engine.schedule.text`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpipe_repro.engine.schedule.core import Schedule

__all__ = ["CHECKPOINT_MODES", "ActionKind", "COMPUTE", "BACKWARDS", "SENDS", "RECVS", "BARRIERS",
           "Action", "ScheduleError"]

CHECKPOINT_MODES = ("always", "except_last", "never")


class ActionKind(str, Enum):
    """What an action does (see the module docstring of :mod:`gpipe_repro.engine.schedule`)."""

    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"
    OPTIMIZER_STEP = "optimizer_step"
    AGREE = "agree"   # barrier: every stage's gradients are final; the stages agree (see module doc)
    # Zero-bubble split of BACKWARD (Qi et al., ICLR 2024): the input gradient (what the previous
    # stage waits for) and the weight gradient (what nobody waits for, placed to fill the bubble).
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"


COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.RECOMPUTE, ActionKind.BACKWARD,
                     ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT, ActionKind.OPTIMIZER_STEP})
# A micro-batch's backward on a stage is either one BACKWARD or a BACKWARD_INPUT then a BACKWARD_WEIGHT.
BACKWARDS = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})
SENDS = frozenset({ActionKind.SEND_ACT, ActionKind.SEND_GRAD})
RECVS = frozenset({ActionKind.RECV_ACT, ActionKind.RECV_GRAD})
BARRIERS = frozenset({ActionKind.AGREE})
_SHORT = {ActionKind.FORWARD: "F", ActionKind.RECOMPUTE: "R", ActionKind.BACKWARD: "B",
          ActionKind.OPTIMIZER_STEP: "U", ActionKind.SEND_ACT: "sa", ActionKind.RECV_ACT: "ra",
          ActionKind.SEND_GRAD: "sg", ActionKind.RECV_GRAD: "rg", ActionKind.AGREE: "A",
          ActionKind.BACKWARD_INPUT: "I", ActionKind.BACKWARD_WEIGHT: "W"}


@dataclass(frozen=True)
class Action:
    """One action of one stage: its kind, its stage, its micro-batch (None for AGREE and U)."""

    kind: ActionKind
    stage: int
    microbatch: int | None = None

    def __str__(self) -> str:
        return f"{_SHORT[self.kind]}{'' if self.microbatch is None else self.microbatch}"

    def peer(self) -> Action:
        """The matching receive of a send, or the matching send of a receive."""
        k, s, m = self.kind, self.stage, self.microbatch
        return {ActionKind.SEND_ACT: Action(ActionKind.RECV_ACT, s + 1, m),
                ActionKind.RECV_ACT: Action(ActionKind.SEND_ACT, s - 1, m),
                ActionKind.SEND_GRAD: Action(ActionKind.RECV_GRAD, s - 1, m),
                ActionKind.RECV_GRAD: Action(ActionKind.SEND_GRAD, s + 1, m)}[k]


class ScheduleError(ValueError):
    """A schedule that a runtime could not execute correctly.

    With `schedule` the message is followed by the schedule in text form, the actions in `at` marked
    ``>>F3<<`` and their lines flagged ``<-- ERROR`` (as PyTorch's ``_format_pipeline_order`` does)."""

    def __init__(self, message: str, schedule: Schedule | None = None,
                 at: Iterable[Action] = ()) -> None:
        super().__init__(message)
        self.message, self.schedule, self.at = message, schedule, tuple(at)

    def __str__(self) -> str:
        if self.schedule is None:
            return self.message
        return f"{self.message}\n{self.schedule.to_text(mark=self.at)}"
