"""THE run loop: every model family trains through this one function, `train(task, config)`.

What a task supplies (:class:`Task`): the layers, the loss, the training batches (an iterator that
can save and restore its position), the optimizer recipe, and how to evaluate a pipeline. What the
loop does with them, the same for every task:

1. build a :class:`~gpipe_repro.GPipe` (K cells, M micro-batches, re-materialization, schedule) and
   one learning-rate schedule for the K per-cell optimizers;
2. resume from the run directory's newest readable checkpoint if asked (weights, optimizers, schedule,
   every random stream, data position, the task's own state such as the augmentation generator),
   after checking, before anything is built, that no setting that changes the result differs;
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
one that never stopped (tests/train/test_resume.py checks every parameter and optimizer slot).

With `--runtime distributed` every stage process runs this same loop on the same batches; GPipe keeps
each process's own cell, and `gpipe_repro/train/ranks.py` makes rank 0 the only writer, gathers the
checkpoint into one file (the same format as a local run's) and makes the ranks stop together.

The run directory (`RunConfig.run_dir`; `gpipe-repro run` picks a fresh `runs/<name>-N`, see
`run_dir.py`), whose files the run lists in its manifest so that nothing else there is ever deleted:

    metrics.jsonl  run.json  wandb/      RunLogger's files (W&B offline run inside wandb/)
    checkpoints/step-00000100.pt ...     the last `keep_checkpoints` saves
    summary.json  summary.md  curves.png the result of the run
    gpipe-run.json                       the manifest: which files this run created

STEP NUMBERS. Every record names a step by the number of steps completed when it was taken: the
console, metrics.jsonl and W&B (`step`), evaluations, checkpoints (`step-00000200.pt` holds the state
after 200 steps) and the curves all say "step 200" for what follows the 200th update, so an
evaluation every 200 steps is at 200, 400, ... everywhere. (Inside the loop, `step` is the 0-based
index of the update being taken, as the learning-rate schedule and `on_step_end` see it.)

The loop itself is `_Run`: `__init__` sets up (resume checks, run directory, data, pipeline,
logging), `run` calls `step` after `step` with `evaluate` and `save` on their cadence, `finish` writes.

The pieces live beside it: the `Task` interface in `task.py`, the engine's construction and state in
`pipeline.py`, the summary and output files in `summary.py`, the progress bar in `console.py`, and
checkpoints, resume checks and Ctrl-C in `checkpoints.py`. Their names are re-exported here, so
`from gpipe_repro.train.loop import Task, train, pipelined_outputs` keeps working.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpipe_repro.engine import microbatch
from gpipe_repro.report.wandb_log import RunLogger
from gpipe_repro.train import ranks
from gpipe_repro.train.checkpoints import (
    Stateful,
    check_resumable,
    checkpoint_path,
    graceful_interrupt,
    latest_checkpoint,
    load_latest_checkpoint,
    restore_training_state,
    save_checkpoint,
    training_state,
)
from gpipe_repro.train.config import RunConfig
from gpipe_repro.train.console import NoLogger, progress_bar
from gpipe_repro.train.instrumentation import parameter_count, timeline_metrics
from gpipe_repro.train.memory_check import check_planned_memory
from gpipe_repro.train.optim import ScheduledLR, lr_function
from gpipe_repro.train.pipeline import (
    PipelineState,
    build_pipeline,
    first_micro_batch,
    pipeline_memory,
    pipelined_outputs,
    place,
    resolve_devices,
)
from gpipe_repro.train.run_dir import RunDirectory
from gpipe_repro.train.summary import RunSummary, accumulate, fresh_stats, make_summary, write_outputs
from gpipe_repro.train.task import Batches, Task

__all__ = ["Batches", "PipelineState", "RunSummary", "Task", "build_pipeline", "check_resumable",
           "pipelined_outputs", "resolve_devices", "train"]


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
    return _Run(task, config).run(on_step_end)


class _Run:
    """One training run in this process: set up (`__init__`), then `run` = `step` after `step`, with
    `evaluate` and `save` on their cadence, and `finish`. In a distributed run every stage process
    holds one; rank 0 alone prints and writes (`self.writer`)."""

    def __init__(self, task: Task, config: RunConfig) -> None:
        self.directory: RunDirectory | None = None
        try:
            self._set_up(task, config)
        except BaseException:
            if self.directory is not None and not config.resume:
                self.directory.abandon()        # a new run that never started leaves nothing behind
            elif self.directory is not None:
                self.directory.release()
            raise

    def _set_up(self, task: Task, config: RunConfig) -> None:
        self.task, self.config = task, config
        # -- where: resume checks come first, before anything is built
        self.rank = ranks.join(config)                     # None unless --runtime distributed
        self.writer = ranks.is_writer(self.rank)
        self.checkpoint: dict[str, Any] | None = None
        self.latest = None
        # the directory is claimed before anything in it is read or removed: a --resume started
        # while the run still trained removed its checkpoint half-written (the temporary file of a
        # save), and that run failed, before the second found the directory taken
        self.directory = (RunDirectory(config.run_dir, task.name, resume=config.resume,
                                       overwrite=config.overwrite) if self.writer
                          else None)
        if config.resume:
            self.checkpoint, self.latest = load_latest_checkpoint(config.checkpoint_dir,
                                                                  remove_leftovers=self.writer)
            for note in check_resumable(self.checkpoint["extra"], config, task):
                self.say(f"note: {note}")

        # -- what: data, length, optimizer recipe
        devices = None if self.rank is not None else resolve_devices(config.device, config.partitions)
        torch.manual_seed(config.seed)                     # weight initialization (the same on every rank)
        self.batches = task.train_batches(config.batch_size, config.seed)
        self.total_steps = config.total_steps(self.batches.batches_per_epoch)
        replicas = f", R={config.replicas} replicas" if config.replicas > 1 else ""
        self.say(f"{task.name}: K={config.partitions}{replicas}, M={config.micro_batches}, mini-batch "
                 f"{config.batch_size} (~{config.batch_size // (config.micro_batches * config.replicas)} "
                 "per micro-batch), "
                 f"{self.total_steps} steps "
                 f"({self.total_steps / self.batches.batches_per_epoch:.3g} epochs), "
                 f"runtime {config.runtime}")
        self.say(f"data: {task.describe_data()}")
        if self.checkpoint is not None and int(self.checkpoint["step"]) > self.total_steps:
            raise ValueError(f"cannot resume: {self.latest} is at step {self.checkpoint['step']}, beyond the "
                             f"run's length of {self.total_steps} steps; give --steps >= "
                             f"{self.checkpoint['step']}")
        optimizer = task.optimizer_config(total_steps=self.total_steps,
                                          steps_per_epoch=self.batches.batches_per_epoch,
                                          batch_size=config.batch_size)
        optimizer = optimizer.replace(name=config.optimizer, lr=config.lr)
        # a size that cannot fit is refused now: one replica's share of the mini-batch, planned
        planner = task.memory_planner(-(-config.batch_size // config.replicas))
        if planner is not None:
            check_planned_memory(planner, config, task.memory_advice())

        # -- the pipeline
        layers = task.build_layers()
        self.params = parameter_count(layers)
        saved = self.checkpoint["state"]["pipeline"] if self.checkpoint else {}
        saved_balance = saved.get("balance")
        # a resumed run splits as it ran ("auto" chose once, from timings that would differ now)
        saved_split = saved.get("split_backwards") if config.split_backwards == "auto" else None
        auto = config.split_backwards == "auto" and saved_split is None
        needs_sample = (config.partition_cost != "params" and config.balance is None
                        and not saved_balance) or auto
        sample = (first_micro_batch(task.sample_batch(config.batch_size), config)
                  if needs_sample else (None, None))
        self.pipe = build_pipeline(layers, config, task.loss_fn(), task.loss_reduction, optimizer,
                                   sample=sample[0], sample_target=sample[1], balance=saved_balance,
                                   devices=devices, split_backwards=saved_split)
        self.schedule = ScheduledLR(self.pipe.optimizers, lr_function(optimizer))
        # said once the settings were accepted: a refused one leaves nothing there to look for
        self.say(f"writing to {config.run_dir}"
                 + (f" (resuming {self.latest.name})" if self.latest is not None else ""))

        # -- what a checkpoint holds, and where this invocation starts
        self.stateful: dict[str, Stateful] = {"pipeline": PipelineState(self.pipe),
                                              "lr_schedule": self.schedule, "data": self.batches,
                                              **task.stateful()}
        self.record = {"run": config.to_dict(), "task": task.config(), "optimizer": optimizer.to_dict()}
        self.start, self.stats = 0, fresh_stats()
        if self.checkpoint is not None:
            self.start = restore_training_state(self.checkpoint, self.stateful)
            self.stats = dict(self.checkpoint["extra"]["stats"])
            self.say(f"resuming {config.name} from {self.latest} (step {self.start} of {self.total_steps})")
        self.losses: list[float] = []
        self.wall0, self.wall_before = time.perf_counter(), self.stats["wall_seconds"]

        # -- logging (rank 0)
        self.logger: RunLogger | NoLogger = NoLogger()
        if self.writer:
            from gpipe_repro.report.provenance import environment
            self.logger = RunLogger(
                config.project, {**self.record, "task_name": task.name, "params": self.params,
                                 "balance": self.pipe.balance, "total_steps": self.total_steps,
                                 "environment": environment()},
                mode=config.wandb, dir=config.run_dir, name=config.name, group=task.name,
                tags=[task.name, f"K{config.partitions}", f"M{config.micro_batches}"],
                # RunLogger drops rows at or after resume_step: those after the checkpoint's step
                resume_step=self.start + 1 if self.checkpoint is not None else None)
            where, mode = self.logger.wandb_run_dir, self.logger.mode
            later = " (upload later with `wandb sync`)" if mode == "offline" else ""
            self.say(f"W&B: {mode} run in {where}{later}" if where is not None else
                     "W&B: disabled (metrics in metrics.jsonl)")
        if self.directory is not None:
            self.directory.update()
        self.progress = progress_bar(config.progress and self.writer, quiet=not self.writer)

    def say(self, message: str) -> None:
        """A line on the console, from rank 0 only."""
        if self.writer:
            print(message, flush=True)

    # ------------------------------------------------------------------------- the loop

    def run(self, on_step_end: Callable[[int, float], None] | None) -> RunSummary:
        """Train from `self.start` to the end (or until a SIGINT/SIGTERM), then `finish`."""
        config, status, done = self.config, "interrupted", self.start
        try:
            with graceful_interrupt() as stop, self.progress:
                bar = self.progress.add_task(f"{config.name}", total=self.total_steps, completed=self.start,
                                             loss=float("nan"), rate=0.0)
                for step in range(self.start, self.total_steps):
                    loss, rate = self.step(step)
                    done = step + 1
                    if config.eval_every and done % config.eval_every == 0 and done < self.total_steps:
                        self.evaluate(done)
                    self.progress.update(bar, completed=done, loss=loss, rate=rate)
                    if on_step_end is not None:
                        on_step_end(step, loss)
                    if ranks.any_rank(stop.requested, self.rank):
                        self.save(done)
                        self.progress.console.print(f"interrupted: saved step {done} to "
                                                    f"{config.checkpoint_dir}; continue with --resume")
                        break
                    if config.save_every and done % config.save_every == 0 and done < self.total_steps:
                        self.save(done)
                        self.progress.console.print(f"step {done}: saved a checkpoint to "
                                                    f"{config.checkpoint_dir}")
                else:
                    status = "finished"
            if status == "finished" and done > self.start:   # a resumed finished run trains nothing:
                self.evaluate(done)                            # its last evaluation and save stand
                self.save(done)
            memory = ranks.gather_metrics(pipeline_memory(self.pipe), self.rank)
        except BaseException:
            self.logger.finish(exit_code=1)
            if self.directory is not None:     # what the failed run wrote is its own, for the next
                self.directory.update()
                self.directory.release()
            raise
        return self.finish(status, done, memory, stop.signal if status == "interrupted" else None)

    def step(self, step: int) -> tuple[float, float]:
        """One synchronous update on the next mini-batch, logged; returns (loss, samples/s)."""
        config, pipe = self.config, self.pipe
        self.task.before_step(step, self.total_steps)
        lr = self.schedule.apply(step)
        done = step + 1                # the step number every record shows (see STEP NUMBERS)
        x, y = place(*next(self.batches), pipe)
        sample_now = config.timeline_every > 0 and step % config.timeline_every == 0
        pipe.record_timeline = sample_now
        t0 = time.perf_counter()
        loss = pipe.train_step(x, y)
        seconds = time.perf_counter() - t0
        pipe.record_timeline = False
        if not math.isfinite(loss):
            raise FloatingPointError(f"the training diverged: the loss is {loss} at step {done}; lower "
                                     f"the learning rate (it was {lr:.3g}) and start the run again")
        if config.precision == "fp16" and pipe.last_step_skipped:   # said, not only in the metrics
            self.stats["skipped_steps"] = self.stats.get("skipped_steps", 0) + 1
            self.progress.console.print(f"step {done}: fp16 overflow, the step was skipped (no cell "
                                        f"updated); the loss scale is now {pipe.loss_scale:g}")
        n = microbatch.batch_size(x)
        self.stats["train_seconds"] += seconds
        self.stats["samples"] += n
        self.losses.append(loss)
        metrics: dict[str, Any] = {}
        if step % config.log_every == 0 or sample_now:
            metrics = {"train/loss": loss, "train/lr": lr, "train/samples_per_s": n / seconds,
                       "train/step_time_s": seconds,
                       "train/epoch": done / self.batches.batches_per_epoch}
            if getattr(pipe, "last_grad_norm", None) is not None:   # global norm (clipping / fp16)
                metrics["train/grad_norm"] = pipe.last_grad_norm
            if config.precision == "fp16":
                metrics["train/loss_scale"] = pipe.loss_scale
        if sample_now and pipe.last_timeline is not None:
            sampled = timeline_metrics(pipe.last_timeline)
            accumulate(self.stats["pipeline"], sampled)
            metrics.update(sampled)
            metrics.update(ranks.gather_metrics(pipeline_memory(pipe), self.rank))
        if metrics:
            self.logger.log(metrics, step=done)
        return loss, n / seconds

    def evaluate(self, done: int) -> dict[str, float]:
        """The task's metrics on held-out data after `done` steps, logged and shown as step `done`
        (a line when it starts, so a long evaluation is never silent, and one with the results and
        its time); best values kept."""
        t0 = time.perf_counter()
        self.progress.console.print(f"step {done}: evaluating ...")
        metrics = self.task.evaluate(self.pipe)
        seconds = time.perf_counter() - t0
        self.progress.console.print(f"step {done}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
                                    + f" (evaluation {seconds:.1f} s)")
        self.stats["eval"] = dict(metrics)
        for key, value in metrics.items():
            better = min if key in self.task.lower_is_better else max
            self.stats["best"][key] = better(self.stats["best"].get(key, value), value)
        self.logger.log({**{f"eval/{k}": v for k, v in metrics.items()},
                         "eval/time_s": seconds}, step=done)
        return metrics

    def save(self, done: int) -> None:
        """A checkpoint after `done` steps. Collective in distributed runs (the pipeline's state is
        gathered); rank 0 writes it and updates the run directory's manifest."""
        self.stats["wall_seconds"] = self.wall_before + time.perf_counter() - self.wall0
        state = training_state(done, self.stateful, extra={**self.record, "stats": self.stats})
        if self.writer:
            bad = _non_finite(state)
            if bad:           # never leave a checkpoint that cannot be resumed from
                raise FloatingPointError(
                    f"the training diverged: after step {done} {len(bad)} tensors of the model or "
                    f"optimizer state hold a NaN or +inf (e.g. {bad[0]}); no checkpoint was saved for this "
                    "step, so --resume would continue from the last finite one. Lower the learning "
                    "rate and start the run again")
            save_checkpoint(checkpoint_path(self.config.checkpoint_dir, done), state,
                            keep_last=self.config.keep_checkpoints)
        if self.directory is not None:
            self.directory.update()

    def finish(self, status: str, done: int, memory: dict[str, float], signum: int | None) -> RunSummary:
        """The summary; rank 0 writes it (summary.json/md, curves, W&B) and closes the logger."""
        summary = make_summary(status, done, self.total_steps, self.stats, self.losses, self.checkpoint,
                               self.pipe, self.params, self.config.run_dir, memory, self.logger)
        summary.signal = signum
        if isinstance(self.logger, RunLogger):        # the writer's
            write_outputs(summary, self.task, self.config, self.record, self.logger)
            latest = latest_checkpoint(self.config.checkpoint_dir) if status == "finished" else None
            if latest is not None:       # the trained model in its own tools' format (causal-lm: hf/)
                self._export(latest)
        self.logger.finish(exit_code=0 if status == "finished" else 1)
        if self.directory is not None:
            self.directory.update()
            self.directory.release()
        return summary


    def _export(self, checkpoint: Path) -> None:
        """The task's export of `checkpoint` into ``hf/``, writing over no file of the user's there
        (only an earlier export of this run, as its manifest lists it); where ``hf/`` holds one, the
        run says so and exports nothing: the checkpoint stays, for ``export_run`` to a new folder."""
        replace: set[str] = set()
        if self.directory is not None:
            replace, theirs = self.directory.ours_in("hf")
            if theirs:
                shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
                self.say(f"the trained model was not exported: {self.config.run_dir / 'hf'} holds files "
                         f"this run did not write ({shown}); export it to a new folder with "
                         "gpipe_repro.train.hf_export.export_run(run_dir, out)")
                return
        exported = self.task.export_model(checkpoint, self.config.run_dir / "hf", replace)
        if exported is not None:
            if self.directory is not None:
                self.directory.claim("hf")
            self.say(f"the trained model, for its own tools: {exported}")


def _non_finite(value: Any, path: str = "") -> list[str]:
    """The paths of the floating tensors in a (nested) checkpoint state that hold a NaN or a +inf:
    weights, BatchNorm statistics (a running variance overflows before the loss does), optimizer
    moments. A -inf is left alone: a causal mask buffer holds them on purpose (and a weight that
    diverged to -inf makes the loss non-finite, which the step catches)."""
    if isinstance(value, torch.Tensor):
        bad = value.is_floating_point() and bool((torch.isnan(value) | (value == float("inf"))).any())
        return [path or "."] if bad else []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _non_finite(v, f"{path}/{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _non_finite(v, f"{path}/{i}")]
    return []
