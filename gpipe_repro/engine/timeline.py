"""Timelines of executed (or simulated) actions, and the paper's time breakdown.

Instrumented runtimes and the simulator both produce a :class:`Timeline`, so a measured run and its
simulation are compared, charted and broken down by the same code. Times are seconds from one clock
reference (the step's start).

The breakdown follows the paper's categories. For each stage, over the step's makespan T:

- computation: FORWARD + BACKWARD; re-computation: RECOMPUTE; optimizer update: OPTIMIZER_STEP;
- AGREE (the barrier before the update) counts as idle: it is waiting for the other stages;
- communication: time the stage spends in sends, plus receive time *after* the data was sent (the
  transfer itself); receive time spent waiting for the producer to send is idle, not communication;
- setup: before the stage's first action;
- idle time (T minus all of the above) is split into load imbalance, ``busiest - this stage's busy
  time`` (idle that exists only because another stage has more work), and bubble, the rest (idle the
  busiest stage has too: fill and drain).

Fractions are of K * T, the total stage-time of the step, so they add up to 1.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CATEGORIES", "Event", "Timeline", "wall_clock"]

CATEGORIES = ("computation", "re-computation", "bubble", "load imbalance", "communication",
              "optimizer update", "setup")
_COMPUTE = {"forward": "computation", "backward": "computation", "recompute": "re-computation",
            "optimizer_step": "optimizer update",
            "backward_input": "computation", "backward_weight": "computation"}   # zero-bubble split


@dataclass
class Event:
    stage: int
    kind: str                 # an ActionKind value ("forward", "recv_grad", ...)
    microbatch: int | None
    start: float
    end: float
    ready: float | None = None  # receives: when the matching send started (data could flow)
    # Under interleaved and V schedules, where each row `stage` is a process running several of the
    # schedule's stages (cells): the schedule's stage of this action. None where each process runs
    # one stage.
    cell: int | None = None

    @property
    def schedule_stage(self) -> int:
        """The stage of the schedule this action belongs to (its cell)."""
        return self.stage if self.cell is None else self.cell

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    num_stages: int
    events: list[Event] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    def stage_events(self, stage: int) -> list[Event]:
        return sorted((e for e in self.events if e.stage == stage), key=lambda e: e.start)

    def busy(self, stage: int) -> dict[str, float]:
        """Seconds per non-idle category for one stage."""
        out = dict.fromkeys(CATEGORIES, 0.0)
        evs = self.stage_events(stage)
        out["setup"] = evs[0].start if evs else 0.0
        for e in evs:
            if e.kind in _COMPUTE:
                out[_COMPUTE[e.kind]] += e.duration
            elif e.kind.startswith("send"):
                out["communication"] += e.duration
            elif e.kind.startswith("recv"):
                begin = e.start if e.ready is None else max(e.start, e.ready)
                out["communication"] += max(0.0, e.end - begin)
        return out

    def breakdown(self) -> dict[str, float]:
        """Fractions of the total stage-time K*T per category (see the module docstring)."""
        T = self.makespan
        if T <= 0:
            return dict.fromkeys(CATEGORIES, 0.0)
        per_stage = [self.busy(s) for s in range(self.num_stages)]
        work = [sum(v for k, v in b.items() if k != "setup") for b in per_stage]
        busiest = max(work)
        total = dict.fromkeys(CATEGORIES, 0.0)
        for b, w in zip(per_stage, work):
            for k, v in b.items():
                total[k] += v
            idle = max(0.0, T - w - b["setup"])
            imbalance = min(idle, busiest - w)
            total["load imbalance"] += imbalance
            total["bubble"] += idle - imbalance
        return {k: v / (T * self.num_stages) for k, v in total.items()}

    def utilization(self) -> list[float]:
        """Per stage, the fraction of the makespan spent computing (incl. recompute and update)."""
        T = self.makespan or 1.0
        return [sum(e.duration for e in self.stage_events(s) if e.kind in _COMPUTE) / T
                for s in range(self.num_stages)]

    def to_json(self) -> dict[str, Any]:
        return {"num_stages": self.num_stages, "meta": self.meta,
                "events": [asdict(e) for e in self.events]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Timeline:
        return cls(data["num_stages"], [Event(**e) for e in data["events"]], data.get("meta", {}))

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        return cls.from_json(json.loads(Path(path).read_text()))


def wall_clock(t0: float | None = None) -> Callable[[], float]:
    """A clock for recording a step's actions: seconds since `t0` (default: now)."""
    origin = time.perf_counter() if t0 is None else t0
    return lambda: time.perf_counter() - origin
