"""What a task gives the run loop: the `Task` interface and its `Batches` stream.

A task supplies the layers, the loss, the training batches (an iterator that can save and restore its
position), the optimizer recipe, and how to evaluate a pipeline; `gpipe_repro/train/loop.py` does the
rest, the same for every task. Adding a task (e.g. translation): subclass :class:`Task` in its own
module under `train/tasks/` and give `gpipe-repro run` a subcommand that builds it (see
gpipe_repro/commands/run.py).
"""
from __future__ import annotations

import abc
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.engine.stage import LossFn
from gpipe_repro.train.checkpoints import Stateful
from gpipe_repro.train.optim import OptimizerConfig


class Batches(Protocol):
    """Training batches forever (the loop counts steps), with a position that can be saved."""

    @property
    def batches_per_epoch(self) -> int: ...

    def __next__(self) -> tuple[Any, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Task(abc.ABC):
    """What to train and how to score it; the loop does the rest (see the module docstring)."""

    name: str = "task"
    loss_reduction: str = "mean"        # GPipe's: "mean" weights micro-batch losses by size
    lower_is_better: tuple[str, ...] = ("loss",)   # eval metrics whose best is the minimum
    #: settings (keys of :meth:`config`) that may be left out for a default whose effect another key
    #: holds: a resume compares that key where one side gave the setting and the other did not
    #: (``--hidden 64`` against a run whose preset's model was 64 wide is no change)
    resolved_in: dict[str, str] = {}

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """The task's settings (JSON-ready): logged, saved in checkpoints, compared on resume."""

    @abc.abstractmethod
    def build_layers(self) -> nn.Sequential:
        """The model as a sequence of pipeline layers (weights initialized from the global seed)."""

    @abc.abstractmethod
    def loss_fn(self) -> LossFn:
        """`loss_fn(output_microbatch, target_microbatch) -> scalar`."""

    @abc.abstractmethod
    def train_batches(self, batch_size: int, seed: int) -> Batches:
        """The training stream: (inputs, targets) ready for the pipeline (augmented, normalized)."""

    @abc.abstractmethod
    def optimizer_config(self, *, total_steps: int, steps_per_epoch: int,
                         batch_size: int) -> OptimizerConfig:
        """The task's optimizer recipe for a run of this length and batch size."""

    @abc.abstractmethod
    def evaluate(self, pipe: GPipe) -> dict[str, float]:
        """Metrics on held-out data with a pipelined forward: `pipelined_outputs(pipe, batches)`
        (which puts the pipe in eval mode). In a distributed run every rank calls it."""

    def stateful(self) -> dict[str, Stateful]:
        """Task state a checkpoint must hold besides the data position (e.g. the augmentation)."""
        return {}

    def before_step(self, step: int, total_steps: int) -> None:  # noqa: B027 - an optional hook
        """Called before each training step (e.g. to ramp drop-path with training progress)."""

    def export_model(self, checkpoint: Path, out: Path, replace: Collection[str] = ()) -> Path | None:
        """The model trained to `checkpoint` (one of this run's) written to `out` in the format the
        model's own tools read (a transformers model folder); None: the task has no such format.
        `out` is new or empty but for `replace` (an earlier export of the run, names relative to
        `out`), which it may write over. Called by the writing process when a run finishes."""
        return None

    def memory_planner(self, batch_size: int) -> Any:
        """A :class:`~gpipe_repro.memory.planner.MemoryPlanner` of the model and a mini-batch of
        `batch_size`, for the run to refuse, before any work, a size that cannot fit
        (:mod:`gpipe_repro.train.memory_check`); None: the run checks nothing."""
        return None

    def memory_advice(self) -> str:
        """What lowers the run's peak memory, in the task's own options (said when it cannot fit)."""
        return ("lower --batch-size, raise --m, or give --checkpoint always; `gpipe-repro fit` shows "
                "what fits")

    def describe_data(self) -> str:
        """One line saying what data the run trains and evaluates on (printed at the start)."""
        settings = self.config()
        for key in ("dataset", "corpus"):
            if settings.get(key):
                return f"{key} {settings[key]}"
        return "the task's own data"

    def sample_batch(self, batch_size: int) -> tuple[Any, Any]:
        """An input batch and its targets for partition costs that run the model ("time", "flops",
        "activations"; the targets time the loss with the last layer)."""
        raise NotImplementedError(f"task {self.name!r} has no sample batch; use partition_cost='params'")
