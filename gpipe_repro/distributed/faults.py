"""Deliberate failures, to check that a failing stage process ends the whole job (and how fast).

:class:`InjectedFault` is an identity layer that, at its n-th call, raises, kills its own process
with SIGKILL (what the OOM killer does), exits without a word, or hangs. Put it in one stage's cell;
`gpipe-repro pipeline --fail-mode kill --fail-rank 1` and the fault tests use it.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any

from torch import nn

from gpipe_repro.engine.choices import require_one_of

FAULT_MODES = ("raise", "kill", "exit", "hang")


class InjectedFault(nn.Module):
    """Identity until its `at_call`-th forward (1-based, recomputations count), then fail as `mode`."""

    def __init__(self, mode: str, at_call: int = 1) -> None:
        super().__init__()
        require_one_of("mode", mode, FAULT_MODES)
        self.mode, self.at_call, self.calls = mode, at_call, 0

    def forward(self, x: Any) -> Any:
        self.calls += 1
        if self.calls == self.at_call:
            if self.mode == "raise":
                raise RuntimeError(f"injected failure at call {self.calls}")
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "exit":
                os._exit(3)
            time.sleep(10**6)  # hang: alive, silent, holding its neighbours' messages
        return x
