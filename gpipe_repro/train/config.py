"""`RunConfig`: how a training run uses the pipeline, independently of what it trains.

Why separate from the task's settings. Everything here (K, M, re-materialization, schedule,
runtime, steps, evaluation and checkpoint cadence, logging) means the same for AmoebaNet and for a
Transformer, so the one run loop (`gpipe_repro/train/loop.py`) reads it; what a model is, which data
it eats and how it is scored belong to the task (`gpipe_repro/train/tasks/image_classification.py`, ...).

Naming: `checkpoint` is GPipe's re-materialization mode (as in `GPipe(checkpoint=...)`); saving
training checkpoints to disk is `save_every` / `keep_checkpoints`.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from gpipe_repro.engine.partition import OBJECTIVES
from gpipe_repro.engine.schedule import CHECKPOINT_MODES, SCHEDULES, SPLIT_SCHEDULES, cells_per_process
from gpipe_repro.train.optim import OPTIMIZERS

RUNTIMES = ("local", "distributed")
LAUNCHERS = ("local", "torchrun")
DEVICES = ("cpu", "cuda", "auto")
WANDB_MODES = ("online", "offline", "disabled")
PARTITION_COSTS = ("params", "time", "flops", "activations")


@dataclasses.dataclass
class RunConfig:
    """A training run's pipeline and bookkeeping settings (the task has its own config)."""

    name: str = "run"
    out_dir: str | None = None          # the run's directory; None -> results/training/<name>
    # -- the pipeline
    partitions: int = 4                 # K
    micro_batches: int = 32             # M
    batch_size: int = 64                # N, examples per mini-batch (one synchronous update)
    checkpoint: str = "except_last"     # re-materialization: "always" | "except_last" | "never"
    schedule: str = "gpipe"             # one of engine.schedule.SCHEDULES
    split_backwards: int | str | None = None  # zero bubble: the last N backwards split, "auto", None all
    balance: list[int] | None = None    # layers per cell; None -> the partitioner
    partition_cost: str = "params"      # per-layer cost the partitioner balances
    objective: str = "bottleneck"       # partitioner objective
    runtime: str = "local"              # "local" (one process) | "distributed" (one process per cell)
    replicas: int = 1                   # R: data-parallel replicas of the pipeline (distributed only)
    launcher: str = "local"             # distributed only: "local" (spawn here) | "torchrun"
    device: str = "cpu"                 # "cpu" | "cuda" (cell k on cuda:k mod #GPUs) | "auto"
    threads: int | None = None          # torch CPU threads; None: torch's default (one per core)
    timeout: float = 600.0              # distributed only: seconds a stage waits for a silent peer
    precision: str = "fp32"             # "fp32" | "bf16" | "fp16" (GPipe(precision=...))
    clip_grad_norm: float | None = None  # one global gradient norm over all cells; None: no clipping
    optimizer: str | None = None        # None: the task's recipe; else one of optim.OPTIMIZERS
    lr: float | None = None             # None: the task's recipe (peak rate, after warm-up)
    # -- how long, how often
    seed: int = 0
    steps: int | None = None            # total optimizer steps; or
    epochs: float | None = None         # ... epochs of the training set (steps wins if both)
    eval_every: int = 0                 # 0: evaluate only at the end
    save_every: int = 0                 # 0: save only at the end (and on Ctrl-C)
    keep_checkpoints: int = 2
    log_every: int = 1                  # per-step metrics cadence
    timeline_every: int = 25            # sample the pipeline's busy/idle timeline every N steps
    # -- logging and resuming
    wandb: str | None = None            # "offline" | "online" | "disabled"; None: $WANDB_MODE, else offline
    project: str = "gpipe-repro"
    resume: bool = False
    overwrite: bool = False             # a new run may replace a finished one of the same task
    progress: bool = True

    def __post_init__(self) -> None:
        checks = [
            (isinstance(self.partitions, int) and self.partitions >= 1,
             f"--k (partitions) must be >= 1, got {self.partitions}"),
            (isinstance(self.micro_batches, int) and self.micro_batches >= 1,
             f"--m (micro-batches) must be >= 1, got {self.micro_batches}"),
            (isinstance(self.batch_size, int) and self.batch_size >= 1,
             f"--batch-size must be >= 1, got {self.batch_size}"),
            (self.batch_size >= self.micro_batches,
             f"--batch-size {self.batch_size} < --m {self.micro_batches}: every micro-batch needs an "
             "example; raise --batch-size or lower --m"),
            (self.checkpoint in CHECKPOINT_MODES,
             f"--checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {self.checkpoint!r}"),
            (self.schedule in SCHEDULES,
             f"--schedule must be one of {', '.join(sorted(SCHEDULES))}, got {self.schedule!r}"),
            (not (self.schedule in SCHEDULES and cells_per_process(self.schedule) > 1
                  and self.runtime == "distributed"),
             f"--schedule {self.schedule} with --runtime distributed: the training commands start one "
             f"process per stage and gather checkpoints that way, while {self.schedule} runs two stages "
             f"per process; use {self.schedule} with the local runtime here, or through the GPipe API "
             "(runtime='distributed')"),
            (self.partition_cost in PARTITION_COSTS,
             f"--partition-cost must be one of {', '.join(PARTITION_COSTS)}, got {self.partition_cost!r}"),
            (self.objective in OBJECTIVES,
             f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}"),
            (self.runtime in RUNTIMES,
             f"--runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}"),
            (self.launcher in LAUNCHERS,
             f"--launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}"),
            (self.optimizer is None or self.optimizer in OPTIMIZERS,
             f"--optimizer {self.optimizer}: unknown; use one of {', '.join(OPTIMIZERS)} (or leave it "
             "out for the task's recipe)"),
            (self.lr is None or (math.isfinite(self.lr) and self.lr > 0),
             f"--lr must be a finite number > 0, got {self.lr!r}"),
            (isinstance(self.replicas, int) and self.replicas >= 1,
             f"--replicas (R) must be an integer >= 1, got {self.replicas!r}"),
            (self.replicas == 1 or self.runtime == "distributed",
             f"--replicas {self.replicas} needs --runtime distributed (K x R = {self.partitions} x "
             f"{self.replicas} processes, one per stage of each replica); the local runtime runs one "
             "pipeline: drop --replicas or add --runtime distributed"),
            (self.batch_size >= self.micro_batches * self.replicas,
             f"batch_size {self.batch_size} < micro_batches x replicas = {self.micro_batches} x "
             f"{self.replicas}: every micro-batch of every replica needs an example; raise --batch-size"),
            (self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}"),
            (self.wandb is None or self.wandb in WANDB_MODES,
             f"--wandb must be one of {', '.join(WANDB_MODES)}, got {self.wandb!r}"),
            (isinstance(self.seed, int) and 0 <= self.seed < 2 ** 63,
             f"seed (--seed) must be a whole number from 0 to 2**63 - 1, got {self.seed}"),
            (self.steps is None or self.steps >= 1, f"--steps must be >= 1, got {self.steps}"),
            (self.epochs is None or self.epochs > 0, f"--epochs must be > 0, got {self.epochs}"),
            (self.steps is not None or self.epochs is not None, "give the run a length: steps or epochs"),
            (self.eval_every >= 0, f"--eval-every must be >= 0 (0: only at the end), got {self.eval_every}"),
            (self.save_every >= 0, f"--save-every must be >= 0 (0: only at the end), got {self.save_every}"),
            (self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}"),
            (self.threads is None or self.threads >= 1, f"--threads must be >= 1, got {self.threads}"),
            (self.timeout > 0, f"--timeout must be > 0 seconds, got {self.timeout}"),
            (self.precision in ("fp32", "bf16", "fp16"),
             f"--precision must be fp32, bf16 or fp16, got {self.precision!r}"),
            (self.clip_grad_norm is None or self.clip_grad_norm > 0,
             f"--clip-grad-norm must be > 0 (or not given), got {self.clip_grad_norm}"),
            (self.log_every >= 1, f"log_every must be >= 1, got {self.log_every}"),
            (self.timeline_every >= 0,
             f"--timeline-every must be >= 0 (0: never), got {self.timeline_every}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        split = self.split_backwards
        if split is not None:
            if self.schedule not in SPLIT_SCHEDULES:
                raise ValueError(f"--split-backwards is for the zero-bubble schedules "
                                 f"({', '.join(SPLIT_SCHEDULES)}); --schedule {self.schedule} runs whole "
                                 "backwards: leave --split-backwards out")
            if split != "auto" and not (isinstance(split, int) and not isinstance(split, bool)
                                        and 0 <= split <= self.micro_batches):
                raise ValueError(f"--split-backwards takes a count from 0 to --m ({self.micro_batches}) or "
                                 f"'auto', got {split!r}")
            if split == "auto" and self.balance is None and self.partition_cost != "time":
                raise ValueError("--split-backwards auto times the layers on the first micro-batch and "
                                 "cuts by those times: add --partition-cost time (this run's is "
                                 f"{self.partition_cost}), or give a count")
        if self.balance is not None and len(self.balance) != self.partitions:
            raise ValueError(f"balance {self.balance} has {len(self.balance)} cells but "
                             f"partitions={self.partitions}")

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("results") / "training" / self.name

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def total_steps(self, steps_per_epoch: int) -> int:
        """`steps`, or `epochs` worth of full batches (at least one step)."""
        if self.steps is not None:
            return self.steps
        assert self.epochs is not None
        return max(1, round(self.epochs * steps_per_epoch))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with `changes` (None values are ignored: "not given on the command line")."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


# Settings that must match for a checkpoint to be resumed: they change what the run computes.
# (Cadence, logging, the runtime and the device may change between a run and its resumption.)
# (`steps` / `epochs` may change: an explicit new length extends the run; see loop.check_resumable.)
# `replicas` too: R replicas of M micro-batches are R x M micro-batches of the mini-batch.
RESUME_MUST_MATCH = ("partitions", "micro_batches", "batch_size", "balance", "partition_cost",
                     "objective", "seed", "optimizer", "lr", "precision", "clip_grad_norm", "replicas")
