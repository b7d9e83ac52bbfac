"""The options the `gpipe-repro` commands share: the same flag for the same thing, everywhere.

    --k / -k          K, partitions (cells, one per device)
    --m / -m          M, micro-batches per mini-batch
    --batch-size      examples per mini-batch
    --devices         devices available (plan)
    --memory          memory per device, GiB
    --out             where a command writes (a run directory, or a JSON file for fit / plan)

Each command module declares its options with these names; tests/commands/test_run.py checks that every
command line in README.md and docs/*.md parses.

The options every `run <task>` command shares (K, M, batch, re-materialization, schedule, runtime, run
directory, cadence, W&B, ...) are declared once, in `PIPELINE_OPTIONS`; `pipeline_options` appends
them to a task command's signature, so a new pipeline option is one line there.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import typer

# the --help panel of the commands that reproduce the paper (each is a make target)
EXPERIMENTS = "The paper's experiments (make targets)"

HELP = {
    "k": "K: partitions (cells, one per device)",
    "m": "M: micro-batches per mini-batch",
    "batch_size": "examples per mini-batch (one synchronous update)",
    "devices": "devices available (K is at most this)",
    "memory": "memory per device, GiB",
}


#: An engine message's argument names, and the command line's options for them.
_AS_FLAGS = ((r"\bpartitions=(\d+)", r"--k \1"), (r"\bmicro_batches=(\d+)", r"--m \1"),
             (r"\bM=(\d+)", r"--m \1"), (r"\bschedule='([\w-]+)'", r"--schedule \1"),
             (r"\bsplit_backwards=", "--split-backwards "), (r"\bbalance=", "--balance "),
             (r"\bpartitions\b", "--k"), (r"\bmicro_batches\b", "--m"),
             (r"\bsplit_backwards\b", "--split-backwards"))


def as_flags(message: str) -> str:
    """An engine or planner message with its argument names as the commands' options
    (partitions=20 -> --k 20, schedule='zb-v' -> --schedule zb-v)."""
    import re
    for pattern, flag in _AS_FLAGS:
        message = re.sub(pattern, flag, message)
    return message


def positive(flag: str, value: int | float | None, what: str = "") -> None:
    """Refuse a count or size below 1 (before any work), saying what it means."""
    if value is not None and value < 1:
        raise typer.BadParameter(f"{flag} must be >= 1{f' ({what})' if what else ''}, got {value}")


def positive_number(flag: str, value: float | None, unit: str = "") -> None:
    """Refuse a rate or size that is not a finite number > 0 (nan, inf, 0, negative)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{flag} must be a number > 0{f' {unit}' if unit else ''}, got {value}")


def int_list(flag: str, text: str | None, example: str = "4,8,32") -> list[int] | None:
    """``"4,8,32"`` -> [4, 8, 32] (None for None); anything else is a usage error naming `flag`."""
    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{flag} takes integers separated by commas (e.g. {example}), got "
                                 f"{text!r}") from None
    return values


def one_of(flag: str, value: str, choices: Sequence[str]) -> None:
    """Refuse a name that is not one of `choices` (before any work)."""
    if value not in choices:
        raise typer.BadParameter(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def check_out_files(flag: str, paths: Sequence[Path], command: str, *, overwrite: bool,
                    own: Callable[[Path], bool] | None = None) -> None:
    """The shared rule for files a command writes where the user said
    (:func:`gpipe_repro.report.output_guard.check_outputs`), as a usage error (exit code 2)."""
    from gpipe_repro.report.output_guard import OutputRefused, check_outputs
    try:
        check_outputs(paths, command=command, option=flag, overwrite=overwrite, own=own)
    except OutputRefused as e:
        raise typer.BadParameter(str(e)) from None


@dataclasses.dataclass(frozen=True)
class SharedOption:
    """One option that every `run <task>` command takes, declared once.

    Args:
        name: the parameter name (the key in the `pipeline` dict the command receives).
        annotation: its type as typer reads it (Optional[int], bool, ...).
        default: the value when the flag is not given (None: keep the preset's value).
        flags: the flag spellings; empty: typer derives `--<name>` from `name`.
        help: the `--help` text.
    """
    name: str
    annotation: Any
    default: Any = None
    flags: tuple[str, ...] = ()
    help: str = ""

    def parameter(self, *, help: Optional[str] = None) -> inspect.Parameter:
        """The keyword-only typer parameter declaring this option (`help` replaces the shared text)."""
        option = typer.Option(self.default, *self.flags, help=help or self.help)
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                 annotation=self.annotation)


# The pipeline / run options of every `run <task>` command, in `--help` order. Options left out keep the
# preset's value (`gpipe_repro.commands.run.apply_pipeline_options` applies them to the RunConfig).
PIPELINE_OPTIONS: tuple[SharedOption, ...] = (
    SharedOption("k", Optional[int], None, ("--k", "-k"), "partitions K (cells, one per device)"),
    SharedOption("replicas", Optional[int], help="R: data-parallel replicas of the pipeline "
                 "(--runtime distributed: K x R processes)"),
    SharedOption("m", Optional[int], None, ("--m", "-m"), "micro-batches M per mini-batch"),
    SharedOption("batch_size", Optional[int], help="examples per mini-batch (one synchronous update)"),
    SharedOption("steps", Optional[int], help="optimizer steps (overrides --epochs)"),
    SharedOption("epochs", Optional[float], help="epochs of the training set"),
    SharedOption("checkpoint", Optional[str], help="re-materialization: always | except_last | never"),
    SharedOption("schedule", Optional[str], help="pipeline schedule: gpipe | 1f1b | interleaved | zb-h1 | "
                 "zb-v | dualpipe-v"),
    SharedOption("split_backwards", Optional[str], help="zero-bubble schedules: split the backwards of the "
                 "last N micro-batches only, or auto (timed on the first micro-batch); default all"),
    SharedOption("objective", Optional[str], help="partitioner objective: bottleneck | variance | greedy | "
                 "equal"),
    SharedOption("partition_cost", Optional[str], help="what the partitioner balances: params | time | "
                 "flops | activations"),
    SharedOption("runtime", Optional[str], help="local (one process) | distributed (one process per cell)"),
    SharedOption("launcher", Optional[str], help="distributed runtime launcher: local | torchrun"),
    SharedOption("device", Optional[str], help="cpu | cuda | auto"),
    SharedOption("threads", Optional[int], help="torch CPU threads (default: the preset's, else one per "
                 "core)"),
    SharedOption("optimizer", Optional[str], help="override the task's optimizer: rmsprop | rmsprop-torch | "
                 "sgd | adam | adamw"),
    SharedOption("lr", Optional[float], help="override the task's peak learning rate"),
    SharedOption("seed", Optional[int], help="seed of weights, data order, augmentation, dropout"),
    SharedOption("eval_every", Optional[int], help="evaluate every N steps (0: only at the end)"),
    SharedOption("save_every", Optional[int], help="save a checkpoint every N steps (0: only at the end and "
                 "on Ctrl-C)"),
    SharedOption("timeline_every", Optional[int], help="sample per-stage busy/idle and memory every N steps "
                 "(0: never)"),
    SharedOption("name", Optional[str], help="run name: the run writes to a fresh runs/<name> "
                 "(runs/<name>-2, ... if taken)"),
    SharedOption("out", Optional[str], help="run directory: empty, new, or (with --overwrite) a finished "
                 "previous run of the same task (only its files are replaced)"),
    SharedOption("overwrite", bool, False, ("--overwrite",), "replace a finished previous run in --out "
                 "(only its own files)"),
    SharedOption("record", bool, False, ("--record",), "write the result of record, "
                 "results/training/<name> (what `make train-*` does)"),
    SharedOption("timeout", Optional[float], help="distributed runs: seconds a stage waits for a silent "
                 "peer before the job fails"),
    SharedOption("precision", Optional[str], help="fp32 | bf16 | fp16 (autocast per cell, fp32 master "
                 "weights; fp16 adds loss scaling)"),
    SharedOption("clip_grad_norm", Optional[float], help="clip the global gradient norm (all cells) to this "
                 "value (default: the task's recipe)"),
    SharedOption("wandb", Optional[str], help="W&B mode: offline | online | disabled (default: $WANDB_MODE, "
                 "else offline)"),
    SharedOption("resume", bool, False, ("--resume",), "continue from the run's latest checkpoint"),
    SharedOption("progress", bool, True, ("--progress/--no-progress",), "show the progress bar"),
)

# name -> help of the shared options, for commands that declare one of them by hand (`run transfer`).
PIPELINE_HELP: dict[str, str] = {o.name: o.help for o in PIPELINE_OPTIONS}


def pipeline_options(*, batch_size_help: Optional[str] = None) -> Callable[[Callable[..., Any]],
                                                                          Callable[..., Any]]:
    """Give a `run <task>` command every option of `PIPELINE_OPTIONS`, declared once.

    The decorated function declares its own options and one parameter `pipeline` (placed where the
    shared options go in `--help`); it is called with `pipeline=` a dict of the shared options' values.
    Typer reads the
    returned command's `__signature__`, so the flags, help and defaults are exactly those declared here.
    `batch_size_help` replaces the help of `--batch-size` (e.g. "sentences per mini-batch").

    Raises:
        TypeError: (at import) the function has no `pipeline` parameter, or one of its own parameters
            has a shared option's name.
    """
    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(command, eval_str=True)
        names = [o.name for o in PIPELINE_OPTIONS]
        clash = sorted(set(own.parameters) & set(names))
        if "pipeline" not in own.parameters or clash:
            raise TypeError(f"{command.__name__} must take a `pipeline` parameter (where the shared options "
                            f"go) and none named like a shared option{f' (it has {clash})' if clash else ''}")
        shared = [o.parameter(help=batch_size_help if o.name == "batch_size" else None)
                  for o in PIPELINE_OPTIONS]
        parameters: list[inspect.Parameter] = []
        for p in own.parameters.values():
            parameters.extend(shared if p.name == "pipeline"
                              else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)])

        @functools.wraps(command)
        def run_command(**values: Any) -> Any:
            pipeline = {name: values.pop(name) for name in names}
            return command(**values, pipeline=pipeline)

        run_command.__signature__ = own.replace(parameters=parameters)  # type: ignore[attr-defined]
        run_command.__annotations__ = {p.name: p.annotation for p in parameters}
        return run_command
    return decorate
