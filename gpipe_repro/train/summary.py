"""The result of a run: `RunSummary`, the statistics a checkpoint carries across resumptions, and
what a finished (or interrupted) run writes: summary.json (measured records), summary.md, curves.png,
the same numbers to W&B, and the table printed at the end."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.report.records import markdown_table, measured, write_json, write_markdown
from gpipe_repro.report.wandb_log import RunLogger, read_metrics
from gpipe_repro.train.config import RunConfig
from gpipe_repro.train.console import NoLogger
from gpipe_repro.train.task import Task


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
    skipped_steps: int = 0               # fp16: steps whose gradients overflowed (no cell updated)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "losses"}


def fresh_stats() -> dict[str, Any]:
    return {"train_seconds": 0.0, "wall_seconds": 0.0, "samples": 0, "eval": {}, "best": {},
            "pipeline": {}}


def accumulate(totals: dict[str, Any], sampled: dict[str, float]) -> None:
    """Running sums of the sampled pipeline fractions (their mean goes into the summary)."""
    totals["samples"] = totals.get("samples", 0) + 1
    for k, v in sampled.items():
        totals[k] = totals.get(k, 0.0) + v


def make_summary(status: str, done: int, total_steps: int, stats: dict[str, Any], losses: list[float],
             checkpoint: dict[str, Any] | None, pipe: GPipe, params: int, run_dir: Path,
             memory: dict[str, float], logger: RunLogger | NoLogger) -> RunSummary:
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
        skipped_steps=int(stats.get("skipped_steps", 0)),
        run_dir=str(run_dir), losses=losses, params=params, balance=list(pipe.balance),
        pipeline={k: round(v / n, 4) for k, v in pipeline.items()} if n else {}, memory=memory)


def write_outputs(summary: RunSummary, task: Task, config: RunConfig, record: dict[str, Any],
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
    flat: dict[str, Any] = {f"eval/{k}": v for k, v in summary.eval.items()}
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
        "machine (see summary.json for the environment); final_train_loss is the mean of the last "
        "(up to) 20 logged training losses.", "", table, "",
        "![curves](curves.png)"]))
    print_summary(summary, metrics)


def print_summary(summary: RunSummary, metrics: dict[str, dict[str, Any]]) -> None:
    from rich.table import Table

    from gpipe_repro.report.records import format_record
    from gpipe_repro.report.terminal import table_console

    table = Table()     # the title on a line of its own: a table's title wraps at the table's width
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(key, format_record(value, 4))
    skipped = (f" ({summary.skipped_steps} skipped: fp16 overflow, no cell updated)"
               if summary.skipped_steps else "")
    print(f"{Path(summary.run_dir).name}: {summary.status}, {summary.steps}/{summary.total_steps} steps"
          f"{skipped}")
    table_console().print(table)
    print("final_train_loss: the mean of the last (up to) 20 logged training losses")
    print(f"run directory: {summary.run_dir}")
