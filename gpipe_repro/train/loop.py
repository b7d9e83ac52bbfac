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

The pieces live beside it: the `Task` interface in `task.py`, the engine's construction and state in
`pipeline.py`, the summary and output files in `summary.py`, the progress bar in `console.py`, and
checkpoints, resume checks and Ctrl-C in `checkpoints.py`. Their names are re-exported here, so
`from gpipe_repro.train.loop import Task, train, pipelined_outputs` keeps working.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
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
    load_latest_checkpoint,
    restore_training_state,
    save_checkpoint,
    training_state,
)
from gpipe_repro.train.config import RunConfig
from gpipe_repro.train.console import NoLogger, progress_bar
from gpipe_repro.train.instrumentation import parameter_count, timeline_metrics
from gpipe_repro.train.optim import ScheduledLR, lr_function
from gpipe_repro.train.pipeline import (
    PipelineState,
    build_pipeline,
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

    start, stats = 0, fresh_stats()
    if checkpoint is not None:
        start = restore_training_state(checkpoint, stateful)
        stats = dict(checkpoint["extra"]["stats"])
        if writer:
            print(f"resuming {config.name} from {latest} (step {start} of {total_steps})")

    logger: RunLogger | NoLogger = NoLogger()
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
        later = " (upload later with `wandb sync`)" if mode == "offline" else ""
        print(f"W&B: {mode} run in {where}{later}" if where is not None else
              "W&B: disabled (metrics in metrics.jsonl)")

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
    progress = progress_bar(config.progress and writer)
    try:
        with graceful_interrupt() as stop, progress:
            bar = progress.add_task(f"{config.name}", total=total_steps, completed=start, loss=float("nan"),
                                    rate=0.0)
            done = start
            for step in range(start, total_steps):
                task.before_step(step, total_steps)
                lr = schedule.apply(step)
                x, y = next(batches)
                x, y = place(x, y, pipe)
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
                    accumulate(stats["pipeline"], sampled)
                    metrics.update(sampled)
                    metrics.update(ranks.gather_metrics(pipeline_memory(pipe), rank))
                if metrics:
                    logger.log(metrics, step=step)
                if config.eval_every and done % config.eval_every == 0 and done < total_steps:
                    shown = evaluate(step)
                    # metrics.jsonl / W&B label a row with the 0-based index of the step it follows
                    progress.console.print(f"step {step} (after {done} steps): " + ", ".join(
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
        memory = ranks.gather_metrics(pipeline_memory(pipe), rank)
    except BaseException:
        logger.finish(exit_code=1)
        raise

    summary = make_summary(status, done, total_steps, stats, losses, checkpoint, pipe, params, run_dir,
                           memory, logger)
    summary.signal = stop.signal if status == "interrupted" else None
    if isinstance(logger, RunLogger):        # the writer's
        write_outputs(summary, task, config, record, logger)
    logger.finish(exit_code=0 if status == "finished" else 1)
    if directory is not None:
        directory.update()
    return summary
