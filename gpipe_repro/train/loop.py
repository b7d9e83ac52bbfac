"""THE run loop: every model family trains through this one function, `train(task, config)`.

What a task supplies (:class:`Task`): the layers, the loss, the training batches (an iterator that
can save and restore its position), the optimizer recipe, and how to evaluate a pipeline. What the
loop does with them, the same for every task:

1. build a :class:`~gpipe_repro.GPipe` (K cells, M micro-batches, re-materialization, schedule) and
   one learning-rate schedule for the K per-cell optimizers;
2. resume from the run directory's latest checkpoint if asked (weights, optimizers, schedule, every
   random stream, data position, the task's own state such as the augmentation generator);
3. train step by step with a progress bar, logging the loss, learning rate and samples/s to
   :class:`~gpipe_repro.report.wandb_log.RunLogger` (W&B, offline by default, plus metrics.jsonl), and every
   `timeline_every` steps the per-stage busy/idle fractions and peak memory;
4. evaluate every `eval_every` steps (pipelined forward), save a checkpoint atomically every
   `save_every` steps, and on Ctrl-C/SIGTERM finish the step, save and exit cleanly;
5. evaluate at the end, save, and write the summary (printed, summary.json, summary.md) and the
   curves (curves.png, also sent to W&B).

Why resuming is exact: the engine's randomness is a function of (seed, step, layer, micro-batch), the
data order of (seed, epoch), the learning rate of the step, and the augmentation has its own saved
generator; so a run killed at any point and resumed from a checkpoint ends with the same weights as
one that never stopped (tests/test_train_resume.py checks every parameter and optimizer slot).

With `--runtime distributed` every stage process runs this same loop on the same batches; GPipe keeps
each process's own cell, and `gpipe_repro/train/ranks.py` makes rank 0 the only writer, gathers the
checkpoint into one file (the same format as a local run's) and makes the ranks stop together.

The run directory (`results/training/<name>/` by default):

    metrics.jsonl  run.json  wandb/      RunLogger's files (W&B offline run inside wandb/)
    checkpoints/step-00000100.pt ...     the last `keep_checkpoints` saves
    summary.json  summary.md  curves.png the result of the run

Adding a task (e.g. translation): subclass :class:`Task` in its own module and give `gpipe-repro run`
a subcommand that builds it (see gpipe_repro/commands/run.py).
"""
from __future__ import annotations

import abc
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from gpipe_repro.engine import microbatch
from gpipe_repro.engine.boundary import to_device
from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.engine.stage import LossFn
from gpipe_repro.report.records import markdown_table, measured, read_json, write_json, write_markdown
from gpipe_repro.report.wandb_log import RunLogger, read_metrics
from gpipe_repro.train import ranks
from gpipe_repro.train.checkpoints import (
    Stateful,
    checkpoint_path,
    graceful_interrupt,
    load_latest_checkpoint,
    restore_training_state,
    save_checkpoint,
    training_state,
)
from gpipe_repro.train.config import RESUME_MUST_MATCH, RunConfig
from gpipe_repro.train.instrumentation import memory_metrics, parameter_count, timeline_metrics
from gpipe_repro.train.optim import OptimizerConfig, ScheduledLR, lr_function, optimizer_factory
from gpipe_repro.train.run_dir import RunDirectory



# ----------------------------------------------------------------------------- the task

class Batches(Protocol):
    """Training batches forever (the loop counts steps), with a position that can be saved."""

    batches_per_epoch: int

    def __next__(self) -> tuple[Any, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Task(abc.ABC):
    """What to train and how to score it; the loop does the rest (see the module docstring)."""

    name: str = "task"
    loss_reduction: str = "mean"        # GPipe's: "mean" weights micro-batch losses by size
    lower_is_better: tuple[str, ...] = ("loss",)   # eval metrics whose best is the minimum

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

    def before_step(self, step: int, total_steps: int) -> None:
        """Called before each training step (e.g. to ramp drop-path with training progress)."""

    def describe_data(self) -> str:
        """One line saying what data the run trains and evaluates on (printed at the start)."""
        settings = self.config()
        for key in ("dataset", "corpus"):
            if settings.get(key):
                return f"{key} {settings[key]}"
        return "the task's own data"

    def sample_batch(self, batch_size: int) -> Any:
        """An input batch for partition costs that run the model ("time", "flops", "activations")."""
        raise NotImplementedError(f"task {self.name!r} has no sample batch; use partition_cost='params'")


# ----------------------------------------------------------------------------- the pipeline

def resolve_devices(device: str, partitions: int) -> list[torch.device] | None:
    """One device per cell: None (the layers' device, the CPU) or cuda:(k mod #GPUs)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device "
                           f"(torch {torch.__version__}); use --device cpu")
    count = torch.cuda.device_count()
    return [torch.device("cuda", k % count) for k in range(partitions)]


def build_pipeline(layers: nn.Sequential, config: RunConfig, loss_fn: LossFn, loss_reduction: str,
                   optimizer: OptimizerConfig, sample: Any = None, balance: list[int] | None = None,
                   devices: list[torch.device] | None = None) -> GPipe:
    """The engine: every cell in this process on `devices` (runtime "local"), or this process's cell
    of a job of K stage processes (runtime "distributed"; the device is the rank's, see `ranks.join`)."""
    return GPipe(layers, partitions=config.partitions, micro_batches=config.micro_batches,
                 checkpoint=config.checkpoint, balance=balance or config.balance,
                 cost=config.partition_cost, sample=sample, objective=config.objective,
                 devices=None if config.runtime == "distributed" else devices, loss_fn=loss_fn, loss_reduction=loss_reduction, optimizer=optimizer_factory(optimizer),
                 schedule=config.schedule, seed=config.seed, runtime=config.runtime)


class PipelineState:
    """`GPipe.training_state()` under the `state_dict` names `checkpointing.training_state` uses.

    In a distributed run it is the whole pipeline's state, gathered on rank 0 (None on the other
    ranks, which do not write), and each rank loads its own cell's part of it.
    """

    def __init__(self, pipe: GPipe) -> None:
        self.pipe = pipe

    def state_dict(self) -> dict[str, Any] | None:
        return ranks.gather_training_state(self.pipe)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pipe.load_training_state(ranks.own_part(state, self.pipe))


def pipelined_outputs(pipe: GPipe, batches: Iterator[Any]) -> Iterator[Any]:
    """`pipe.forward` over batches in eval mode (training mode restored afterwards)."""
    was_training = pipe.training
    pipe.eval()
    try:
        for x in batches:
            yield pipe.forward(x)
    finally:
        pipe.train(was_training)


# ----------------------------------------------------------------------------- the result

@dataclasses.dataclass
class RunSummary:
    """What `train` returns (and writes as summary.json)."""

    status: str                          # "finished" | "interrupted"
    steps: int                           # steps completed in total (across resumptions)
    total_steps: int
    eval: dict[str, float]               # the last evaluation
    best: dict[str, float]               # the best value of each eval metric
    train_seconds: float                 # time inside train_step, summed over resumptions
    wall_seconds: float                  # loop wall time incl. evaluation and saving
    samples_per_s: float                 # mean training throughput (train_step time)
    final_train_loss: float              # mean of the last (up to) 20 logged losses
    resumed_from: int | None
    run_dir: str
    losses: list[float]                  # the losses of the steps this invocation ran
    params: int
    balance: list[int]
    pipeline: dict[str, float]           # mean of the sampled busy/idle/breakdown fractions
    memory: dict[str, float]
    signal: int | None = None            # the signal that interrupted the run (SIGINT, SIGTERM), if any

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "losses"}


# ----------------------------------------------------------------------------- the loop

def train(task: Task, config: RunConfig, *,
          on_step_end: Callable[[int, float], None] | None = None) -> RunSummary:
    """Train `task` as `config` says; returns (and writes) the run's summary.

    `on_step_end(step, loss)` is called after every step (tests use it to kill a run midway).
    """
    threads_before = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        return _train(task, config, on_step_end)
    finally:
        torch.set_num_threads(threads_before)


def _train(task: Task, config: RunConfig, on_step_end: Callable[[int, float], None] | None
           ) -> RunSummary:
    rank = ranks.join(config)                   # None unless --runtime distributed
    writer = ranks.is_writer(rank)
    run_dir = config.run_dir
    checkpoint, latest = None, None
    if config.resume:
        checkpoint, latest = load_latest_checkpoint(config.checkpoint_dir)
        notes = check_resumable(checkpoint["extra"], config, task)     # before anything is built
        if writer:
            for note in notes:
                print(f"note: {note}")
    directory = RunDirectory(run_dir, task.name, resume=config.resume) if writer else None

    devices = None if rank is not None else resolve_devices(config.device, config.partitions)
    torch.manual_seed(config.seed)               # weight initialization (the same on every rank)
    batches = task.train_batches(config.batch_size, config.seed)
    total_steps = config.total_steps(batches.batches_per_epoch)
    if writer:
        print(f"{task.name}: K={config.partitions}, M={config.micro_batches}, mini-batch {config.batch_size} "
              f"(~{config.batch_size // config.micro_batches} per micro-batch), {total_steps} steps "
              f"({total_steps / batches.batches_per_epoch:.3g} epochs), runtime {config.runtime}")
        print(f"data: {task.describe_data()}")
        print(f"writing to {run_dir}" + (f" (resuming {latest.name})" if latest is not None else ""))
    if checkpoint is not None and int(checkpoint["step"]) > total_steps:
        raise ValueError(f"cannot resume: {latest} is at step {checkpoint['step']}, beyond the run's "
                         f"length of {total_steps} steps; give --steps >= {checkpoint['step']}")
    optimizer = task.optimizer_config(total_steps=total_steps, steps_per_epoch=batches.batches_per_epoch,
                                      batch_size=config.batch_size)
    optimizer = optimizer.replace(name=config.optimizer, lr=config.lr)
    layers = task.build_layers()
    params = parameter_count(layers)
    needs_sample = config.partition_cost != "params" and config.balance is None
    saved_balance = checkpoint["state"]["pipeline"]["balance"] if checkpoint else None
    pipe = build_pipeline(layers, config, task.loss_fn(), task.loss_reduction, optimizer,
                          sample=task.sample_batch(config.batch_size) if needs_sample and not saved_balance
                          else None, balance=saved_balance, devices=devices)
    schedule = ScheduledLR(pipe.optimizers, lr_function(optimizer))
    stateful: dict[str, Stateful] = {"pipeline": PipelineState(pipe), "lr_schedule": schedule,
                                     "data": batches, **task.stateful()}
    record = {"run": config.to_dict(), "task": task.config(), "optimizer": optimizer.to_dict()}

    start, stats = 0, _fresh_stats()
    if checkpoint is not None:
        start = restore_training_state(checkpoint, stateful)
        stats = dict(checkpoint["extra"]["stats"])
        if writer:
            print(f"resuming {config.name} from {latest} (step {start} of {total_steps})")

    logger: RunLogger | _NoLogger = _NoLogger()
    if writer:
        from gpipe_repro.report.provenance import environment
        logger = RunLogger(config.project, {**record, "task_name": task.name, "params": params,
                                            "balance": pipe.balance, "total_steps": total_steps,
                                            "environment": environment()},
                           mode=config.wandb, dir=run_dir, name=config.name, group=task.name,
                           tags=[task.name, f"K{config.partitions}", f"M{config.micro_batches}"],
                           resume_step=start if checkpoint is not None else None)
    if directory is not None:
        directory.update()
        where = getattr(logger, "wandb_run_dir", None)
        mode = getattr(logger, "mode", "disabled")
        print("W&B: disabled (metrics in metrics.jsonl)" if where is None else
              f"W&B: {mode} run in {where}" + (" (upload later with `wandb sync`)" if mode == "offline" else ""))

    def save(step: int) -> None:
        """Collective in distributed runs (the pipeline's state is gathered); rank 0 writes."""
        stats["wall_seconds"] = wall_before + time.perf_counter() - wall0
        state = training_state(step, stateful, extra={**record, "stats": stats})
        if writer:
            save_checkpoint(checkpoint_path(config.checkpoint_dir, step), state,
                            keep_last=config.keep_checkpoints)
        if directory is not None:
            directory.update()

    def evaluate(step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = task.evaluate(pipe)
        stats["eval"] = dict(metrics)
        for key, value in metrics.items():
            better = min if key in task.lower_is_better else max
            stats["best"][key] = better(stats["best"].get(key, value), value)
        logger.log({**{f"eval/{k}": v for k, v in metrics.items()},
                    "eval/time_s": time.perf_counter() - t0}, step=step)
        return metrics

    losses: list[float] = []
    status = "interrupted"
    wall0 = time.perf_counter()
    wall_before = stats["wall_seconds"]
    progress = _progress(config.progress and writer)
    try:
        with graceful_interrupt() as stop, progress:
            bar = progress.add_task(f"{config.name}", total=total_steps, completed=start, loss=float("nan"),
                                    rate=0.0)
            done = start
            for step in range(start, total_steps):
                task.before_step(step, total_steps)
                lr = schedule.apply(step)
                x, y = next(batches)
                x, y = _place(x, y, pipe)
                sample_now = config.timeline_every > 0 and step % config.timeline_every == 0
                pipe.record_timeline = sample_now
                t0 = time.perf_counter()
                loss = pipe.train_step(x, y)
                seconds = time.perf_counter() - t0
                pipe.record_timeline = False
                done = step + 1
                if not math.isfinite(loss):
                    raise FloatingPointError(f"the training loss is {loss} at step {step}: lower the "
                                             f"learning rate (it was {lr:.3g}) or resume from an "
                                             "earlier checkpoint")
                n = microbatch.batch_size(x)
                stats["train_seconds"] += seconds
                stats["samples"] += n
                losses.append(loss)
                metrics: dict[str, Any] = {}
                if step % config.log_every == 0 or sample_now:
                    metrics = {"train/loss": loss, "train/lr": lr, "train/samples_per_s": n / seconds,
                               "train/step_time_s": seconds,
                               "train/epoch": (step + 1) / batches.batches_per_epoch}
                if sample_now and pipe.last_timeline is not None:
                    sampled = timeline_metrics(pipe.last_timeline)
                    _accumulate(stats["pipeline"], sampled)
                    metrics.update(sampled)
                    metrics.update(ranks.gather_metrics(_memory(pipe), rank))
                if metrics:
                    logger.log(metrics, step=step)
                if config.eval_every and done % config.eval_every == 0 and done < total_steps:
                    shown = evaluate(step)
                    progress.console.print(f"step {done}: " + ", ".join(
                        f"{k} {v:.4g}" for k, v in shown.items()))
                progress.update(bar, completed=done, loss=loss, rate=n / seconds)
                if on_step_end is not None:
                    on_step_end(step, loss)
                if ranks.any_rank(stop.requested, rank):
                    save(done)
                    progress.console.print(f"interrupted: saved step {done} to {config.checkpoint_dir}; "
                                           "continue with --resume")
                    break
                if config.save_every and done % config.save_every == 0 and done < total_steps:
                    save(done)
            else:
                status = "finished"
        if status == "finished":
            evaluate(max(done - 1, 0))
            save(done)
        memory = ranks.gather_metrics(_memory(pipe), rank)
    except BaseException:
        logger.finish(exit_code=1)
        raise

    summary = _summary(status, done, total_steps, stats, losses, checkpoint, pipe, params, run_dir,
                       memory, logger)
    summary.signal = stop.signal if status == "interrupted" else None
    if writer:
        _write_outputs(summary, task, config, record, logger)
    logger.finish(exit_code=0 if status == "finished" else 1)
    if directory is not None:
        directory.update()
    return summary


# ----------------------------------------------------------------------------- helpers

class _NoLogger:
    """What ranks other than 0 log to: nothing."""

    metrics_path = None

    def log(self, *args: Any, **kwargs: Any) -> None:
        return None

    def finish(self, *args: Any, **kwargs: Any) -> None:
        return None


def _memory(pipe: GPipe) -> dict[str, float]:
    return memory_metrics(pipe.cells, pipe.optimizers, pipe.devices)


def check_resumable(saved: dict[str, Any], config: RunConfig, task: Task) -> list[str]:
    """Refuse to resume a checkpoint made with settings that change what the run computes, listing
    every difference. The run's length may change (an explicit `--steps` / `--epochs` extends it):
    that is returned as a note for the caller to print, not refused."""
    run = saved["run"]
    diffs = [f"{k}: saved {run.get(k)!r}, now {getattr(config, k)!r}" for k in RESUME_MUST_MATCH
             if run.get(k) != getattr(config, k) and not (k == "balance" and getattr(config, k) is None)]
    now = task.config()
    diffs += [f"{k}: saved {saved['task'].get(k)!r}, now {now.get(k)!r}"
              for k in sorted(set(now) | set(saved["task"])) if saved["task"].get(k) != now.get(k)]
    if diffs:
        raise ValueError("cannot resume: the checkpoint was made with different settings:\n  "
                         + "\n  ".join(diffs) + "\nresume with the original settings, or start a new "
                         "run (leave out --resume, or another --name / --out)")
    length = [f"{k} {run.get(k)!r} -> {getattr(config, k)!r}" for k in ("steps", "epochs")
              if run.get(k) != getattr(config, k)]
    return [f"the run's length changes ({', '.join(length)}); the learning-rate schedule follows the "
            "new length from here"] if length else []


def _fresh_stats() -> dict[str, Any]:
    return {"train_seconds": 0.0, "wall_seconds": 0.0, "samples": 0, "eval": {}, "best": {},
            "pipeline": {}}


def _accumulate(totals: dict[str, Any], sampled: dict[str, float]) -> None:
    """Running sums of the sampled pipeline fractions (their mean goes into the summary)."""
    totals["samples"] = totals.get("samples", 0) + 1
    for k, v in sampled.items():
        totals[k] = totals.get(k, 0.0) + v


def _place(x: Any, y: Any, pipe: GPipe) -> tuple[Any, Any]:
    """Inputs to the first cell's device, targets to the last cell's (where the loss runs)."""
    return to_device(x, pipe.devices[0]), to_device(y, pipe.devices[-1])


class _NoProgress:
    """Stand-in for rich.progress.Progress when the bar is off (tests, logs)."""

    def __init__(self) -> None:
        from rich.console import Console
        self.console = Console(quiet=True)

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None


def _progress(enabled: bool) -> Any:
    if not enabled:
        return _NoProgress()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}"),
                    TextColumn("{task.fields[rate]:.1f} samples/s"), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn())


def _summary(status: str, done: int, total_steps: int, stats: dict[str, Any], losses: list[float],
             checkpoint: dict[str, Any] | None, pipe: GPipe, params: int, run_dir: Path,
             memory: dict[str, float], logger: RunLogger | _NoLogger) -> RunSummary:
    path = logger.metrics_path
    rows = read_metrics(path) if path is not None and path.is_file() else []
    logged = [r["train/loss"] for r in rows if "train/loss" in r] or losses
    pipeline = dict(stats["pipeline"])
    n = pipeline.pop("samples", 0)
    return RunSummary(
        status=status, steps=done, total_steps=total_steps, eval=dict(stats["eval"]),
        best=dict(stats["best"]), train_seconds=round(stats["train_seconds"], 3),
        wall_seconds=round(stats["wall_seconds"], 3),
        samples_per_s=round(stats["samples"] / stats["train_seconds"], 3) if stats["train_seconds"] else 0.0,
        final_train_loss=round(sum(logged[-20:]) / len(logged[-20:]), 5) if logged else float("nan"),
        resumed_from=int(checkpoint["step"]) if checkpoint is not None else None,
        run_dir=str(run_dir), losses=losses, params=params, balance=list(pipe.balance),
        pipeline={k: round(v / n, 4) for k, v in pipeline.items()} if n else {}, memory=memory)


def _write_outputs(summary: RunSummary, task: Task, config: RunConfig, record: dict[str, Any],
                   logger: RunLogger) -> None:
    """summary.json (measured records), summary.md, curves.png; the same numbers to W&B."""
    from gpipe_repro.train.curves import plot_run_curves

    run_dir = config.run_dir
    metrics = {f"eval_{k}": measured(v) for k, v in summary.eval.items()}
    metrics.update({f"best_{k}": measured(v) for k, v in summary.best.items()})
    metrics["final_train_loss"] = measured(summary.final_train_loss)
    metrics["train_time"] = measured(summary.train_seconds, unit="s")
    metrics["wall_time"] = measured(summary.wall_seconds, unit="s")
    metrics["samples_per_s"] = measured(summary.samples_per_s, unit="samples/s")
    write_json(run_dir / "summary.json", {"kind": "training-run", "task": task.name, **summary.to_json(),
                                          "metrics": metrics, "config": record})
    rows = read_metrics(logger.metrics_path) if logger.metrics_path.is_file() else []
    curves = plot_run_curves(rows, run_dir / "curves.png",
                             f"{config.name}: {task.name}, K={config.partitions}, M={config.micro_batches}")
    logger.log_image("curves", curves)
    flat = {f"eval/{k}": v for k, v in summary.eval.items()}
    flat.update({f"best/{k}": v for k, v in summary.best.items()})
    flat.update({"status": summary.status, "steps": summary.steps, "train_seconds": summary.train_seconds,
                 "wall_seconds": summary.wall_seconds, "samples_per_s": summary.samples_per_s,
                 "final_train_loss": summary.final_train_loss, "params": summary.params})
    flat.update({k: v for k, v in summary.memory.items()})
    logger.summary(flat)
    table = markdown_table(["metric", "value"], [[k, v] for k, v in metrics.items()])
    write_markdown(run_dir / "summary.md", "\n".join([
        f"# {config.name} ({task.name})", "",
        f"Status **{summary.status}** after {summary.steps} of {summary.total_steps} steps; "
        f"K={config.partitions}, M={config.micro_batches}, batch {config.batch_size}, "
        f"balance {summary.balance}, {summary.params:,} parameters. All numbers measured on this "
        "machine (see summary.json for the environment).", "", table, "",
        "![curves](curves.png)"]))
    _print_summary(summary, metrics)


def _print_summary(summary: RunSummary, metrics: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from gpipe_repro.report.records import format_record

    table = Table(title=f"{Path(summary.run_dir).name}: {summary.status}, {summary.steps}/{summary.total_steps} steps")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(key, format_record(value, 4))
    Console().print(table)
    print(f"run directory: {summary.run_dir}")
