"""What decides a throughput table: the models, the batch policies and :class:`SweepSettings`."""
from __future__ import annotations

from dataclasses import dataclass

from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.report.host import usable_cores
from gpipe_repro.repro.throughput.workloads import SCALED_MICROBATCH

MODELS = ("amoebanet", "transformer")
POLICIES = ("micro", "mini")


@dataclass(frozen=True)
class SweepSettings:
    """Everything that decides a throughput table (recorded in its JSON)."""

    ks: tuple[int, ...] = (2, 4, 8)
    ms: tuple[int, ...] = (1, 4, 32)
    policy: str = "micro"                 # "micro": N = M x b;  "mini": N fixed, b = N / M
    microbatch: tuple[tuple[str, int], ...] = tuple(SCALED_MICROBATCH.items())
    minibatch: int = 64                   # N of the "mini" policy
    checkpoint: str = "always"
    recompute_ahead: bool = False
    schedule: str = "gpipe"
    split_backwards: int | None = None    # zero bubble: the last micro-batches whose backward splits
    objective: str = "bottleneck"
    link: str = "gloo-loopback"
    device: str = "cpu"
    method: str = "time"
    repeats: int = 10                   # timings per layer action and round (trimmed mean)
    calibration_rounds: int = 3         # rounds per layer, interleaved; the median round is kept
    calibration_max_rounds: int = 6     # more rounds while the costs' interval is wider than 0.5%
    threads: int | None = 1             # torch threads per stage (None: leave as is, e.g. GPU)
    neighbours: int | None = None       # busy cores while timing (None: the pipeline's, see below)
    paper_size: bool = False
    measure: bool = True
    measure_steps: int = 4
    time_limit_s: float | None = None   # the whole table's wall-clock: the measured rounds share
                                        # what calibrating and simulating left (measure.round_budget)

    def microbatch_size(self, model: str, m: int) -> int:
        if self.policy == "mini":
            return self.minibatch // m
        return dict(self.microbatch)[model]

    def batch_size(self, model: str, m: int) -> int:
        return self.minibatch if self.policy == "mini" else m * dict(self.microbatch)[model]

    def sizes(self, model: str) -> list[int]:
        return sorted({self.microbatch_size(model, m) for m in self.ms})

    def busy_neighbours(self) -> int:
        """Cores kept busy while timing layers on a CPU: those a pipeline's other stages occupy
        here (K - 1, at most the other usable cores)."""
        if self.neighbours is not None:
            return self.neighbours
        if self.device != "cpu":
            return 0
        return max(0, min(usable_cores(), max(self.ks)) - 1)

    def validate(self) -> None:
        require_one_of("policy", self.policy, POLICIES)
        if self.policy == "mini":
            bad = [m for m in self.ms if self.minibatch % m]
            if bad:
                raise ValueError(f"mini-batch {self.minibatch} does not split evenly into M={bad}: "
                                 "use a mini-batch divisible by every M")
        if min(self.ks) < 1 or min(self.ms) < 1:
            raise ValueError("K and M must be >= 1")

