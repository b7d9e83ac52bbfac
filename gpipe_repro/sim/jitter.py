"""How much a compute action's duration varies inside a pipeline on this host, for the simulator to
draw from.

Why: a pipeline's step waits, at every dependency, for the later of two actions, so where actions'
durations vary the step is longer than the same schedule with every action at its expected
duration. On this project's 2-vCPU host (each core switching between a fast state and one about 2x
slower every few milliseconds; the stage processes' communication threads sharing the same cores)
the cell actions of a K=2 pipeline (10-30 ms) varied with a coefficient of variation of 0.11-0.22,
two to four times what the same layers vary by in calibration beside a busy neighbour (0.04-0.09).
Replaying measured steps (Transformer-48 and AmoebaNet-D, K=2, M=2 and 8) with every action at its
(stage, kind)'s median duration gave steps 5-12% shorter than measured, at their means 1-7%, while
drawing each action's duration from the measured ones (200 draws, the median step) came within 3%.
A simulation that compares itself with this host's measured steps draws its actions' durations
the same way (:func:`gpipe_repro.sim.simulator.simulate` with a :class:`Jitter`); the figure is
then the median simulated step, as the measured figure is the median measured step.

What is measured (:func:`measure_jitter`, cached per host; validate-sim and validate-unseen measure
it afresh at their start, as they calibrate afresh, since it moves with the host's phases as the
costs do): real pipelines on this host's stage
processes (K=2, M=8, gloo, one thread each) of cells of 1, 4, 16 and 48 small Linear layers, so
that forwards and backwards span about 0.6 to 50 ms; each action's duration over the robust mean of
its stage and kind in its run (:func:`gpipe_repro.sim.calibration.robust_seconds`, the statistic
of the calibrated costs) is a factor, and an action draws a factor of the class whose length is
nearest its own (a recompute or an optimizer step too, by its length). The factors' mean is not 1
where a class has a long slow tail: a trimmed mean leaves the tail out, a pipeline pays it, so the
draws move the level as well as the waiting. Drawn independently per action: the host's states
last a few milliseconds, shorter than most cell actions; an action longer than the longest class
borrows that class's spread, which overstates it. These generic layers vary less than the
harness's models do in the same pipeline (coefficient of variation 0.05-0.13 at 10-50 ms in
separate measurements, against 0.11-0.22 for the cells of Transformer-48 and AmoebaNet-D), so the
drawn steps are a lower bound on the effect: on validate-sim's 40 configurations they moved the
simulated step by -1.4% to +5.0% (median +0.5%) in one run and +0.4% to +11.6% (median +5.0%) in
the next, each with a variation measured at a different hour.
"""
from __future__ import annotations

import bisect
import functools
import json
import math
import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpipe_repro.report.records import atomic_write

#: layers per cell of the measured pipelines (forwards and backwards of about 0.6 to 50 ms)
CELL_LAYERS = (1, 4, 16, 48)
WIDTH, ROWS = 384, 128    # each Linear layer's width; rows per micro-batch (about 0.6 ms a forward)
MICROBATCHES, STEPS = 8, 6
DRAWS = 63                # simulated steps per drawn simulation (odd: the median is one of them)


@dataclass(frozen=True)
class Jitter:
    """Measured duration factors by length: ``factors[i]`` are timings of work of about
    ``lengths[i]`` seconds, each over the robust mean of its length."""

    lengths: tuple[float, ...]
    factors: tuple[tuple[float, ...], ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.lengths or len(self.lengths) != len(self.factors) or not all(self.factors):
            raise ValueError("a Jitter needs at least one length, with factors for every length")
        if list(self.lengths) != sorted(self.lengths) or self.lengths[0] <= 0:
            raise ValueError(f"lengths must be positive and ascending, got {self.lengths}")

    def factor(self, seconds: float, rng: random.Random) -> float:
        """A factor for an action of `seconds`: drawn from the measured length nearest it (in ratio)."""
        if seconds <= 0:
            return 1.0
        i = bisect.bisect_left(self.lengths, seconds)
        if i == len(self.lengths) or (i > 0 and math.log(seconds / self.lengths[i - 1])
                                      < math.log(self.lengths[i] / seconds)):
            i -= 1
        return rng.choice(self.factors[i])

    def spread(self) -> list[tuple[float, float]]:
        """(length, coefficient of variation) per class, shortest first (for pages)."""
        out = []
        for length, f in zip(self.lengths, self.factors):
            mean = sum(f) / len(f)
            out.append((length, math.sqrt(sum((x - mean) ** 2 for x in f) / len(f)) / mean))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"lengths": list(self.lengths), "factors": [list(f) for f in self.factors],
                "source": self.source}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Jitter:
        return cls(tuple(float(x) for x in data["lengths"]),
                   tuple(tuple(float(x) for x in f) for f in data["factors"]), str(data.get("source", "")))


def _jitter_layers(count: int) -> list[Any]:
    from torch import nn

    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(count)]


def durations_by_class(timelines: Sequence[Any]) -> list[list[float]]:
    """The FORWARD and BACKWARD durations of measured steps, one list per (stage, kind)."""
    groups: dict[tuple[int, str], list[float]] = {}
    for t in timelines:
        for e in t.events:
            if e.kind in ("forward", "backward"):
                groups.setdefault((e.stage, e.kind), []).append(e.duration)
    return [groups[key] for key in sorted(groups)]


def jitter_from_durations(classes: Sequence[Sequence[float]], source: str = "") -> Jitter:
    """A Jitter from classes of durations of one action repeated (one stage's forwards in one run,
    ...): each class's length is its robust mean, its factors its durations over that mean."""
    from gpipe_repro.sim.calibration.timing import robust_seconds

    found = sorted((robust_seconds(c), tuple(sorted(x / robust_seconds(c) for x in c)))
                   for c in classes if c)
    return Jitter(tuple(length for length, _ in found), tuple(f for _, f in found), source)


def measure_jitter(*, refresh: bool = False, cache: Path | None = None) -> Jitter:
    """This host's action-duration factors inside a pipeline (see the module docstring), measured
    once and cached."""
    import torch

    from gpipe_repro.distributed.measure import measure_pipeline
    from gpipe_repro.sim.cache import cache_dir

    key = (f"jitter-{socket.gethostname()}-torch{torch.__version__}-{WIDTH}x{ROWS}-"
           f"{'-'.join(map(str, CELL_LAYERS))}x{MICROBATCHES}x{STEPS}.json")
    path = cache or cache_dir() / "host" / key
    if path.exists() and not refresh:
        return Jitter.from_json(json.loads(path.read_text()))
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(ROWS * MICROBATCHES, WIDTH, generator=g),
             torch.randint(0, WIDTH, (ROWS * MICROBATCHES,), generator=g))
    classes: list[list[float]] = []
    for n in CELL_LAYERS:
        m = measure_pipeline(functools.partial(_jitter_layers, 2 * n), [n, n], MICROBATCHES, batch,
                             checkpoint="never", steps=STEPS, warmup=2)
        classes += durations_by_class(m.timelines)
    jitter = jitter_from_durations(
        classes, source=f"measured on {socket.gethostname()}: K=2 pipelines (gloo, 1 thread per "
                        f"stage) of {', '.join(map(str, CELL_LAYERS))} Linear({WIDTH}, {WIDTH}) "
                        f"layers per cell, M={MICROBATCHES} of {ROWS} rows, {STEPS} steps each")
    with atomic_write(path) as f:
        json.dump(jitter.to_json(), f, indent=2)
    return jitter
