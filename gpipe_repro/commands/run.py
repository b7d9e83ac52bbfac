"""`gpipe-repro run <task>`: train a model through the pipeline, with logging, checkpoints and resume.

    gpipe-repro run amoebanet --preset cpu                   # ~7 min on 2 CPU cores, MNIST sample
    gpipe-repro run amoebanet --k 4 --m 32 --batch-size 128  # the preset's model, another pipeline
    gpipe-repro run amoebanet --preset cpu --resume          # continue a killed / Ctrl-C'd run
    gpipe-repro run amoebanet --preset paper                 # AmoebaNet-B (18, 512), 480x480, GPUs
    gpipe-repro run transfer --from results/training/amoebanet-cpu --dataset digits --seeds 3

One subcommand per task; every one builds a `Task` factory and a `RunConfig` and hands them to
`run_task`, which starts the one run loop (`gpipe_repro.train.loop.train`) in this process or, with
`--runtime distributed`, in K stage processes (`gpipe_repro.train.ranks.launch`). To add a task (e.g.
`transformer`), write its Task in `gpipe_repro/train/<task>.py` and add a function here decorated with
`@group.command("<task>")` and `@pipeline_options()` (the shared options, declared once in
`gpipe_repro/commands/options.py`), taking a `pipeline` dict and calling `run_task`, as `amoebanet`
does. Options left out keep the preset's value.

    torchrun --nproc-per-node 4 $(which gpipe-repro) run amoebanet --k 4 --runtime distributed \
        --launcher torchrun                                  # one process per cell, under torchrun
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NoReturn, Optional

import typer

from gpipe_repro.commands.options import PIPELINE_HELP, pipeline_options, positive

# Fewer examples than this per micro-batch and per-micro-batch BatchNorm statistics are noise
# (with 2 examples AmoebaNet stays at chance level).
MIN_BATCHNORM_MICRO_BATCH = 8


def follow_micro_batches(run_config: Any, options: dict[str, Any], *,
                         batchnorm: bool = True) -> tuple[dict[str, Any], str | None]:
    """The batch (and length) to use when `--m` is given without `--batch-size`.

    With `batchnorm` (AmoebaNet) the mini-batch grows with M so that every micro-batch keeps at
    least MIN_BATCHNORM_MICRO_BATCH examples (as the paper grew its batch with M), and never shrinks
    below the preset's; the learning rate follows the batch (the task's linear scaling rule, Goyal
    et al. 2017). Without, it grows only where M exceeds it, to one row per micro-batch. A larger
    batch takes fewer steps per epoch, so a preset given in epochs gets half an epoch more per
    doubling of the batch (measured for the cpu preset: M=32, batch 256 reaches 90.1% top-1 in 7
    epochs and 85.2% in 6). Returns (the options to change, a note to print)."""
    import math

    m, batch = options.get("m"), options.get("batch_size")
    if m is None or batch is not None or m == run_config.micro_batches:
        return {}, None
    new = max(run_config.batch_size, m * (MIN_BATCHNORM_MICRO_BATCH if batchnorm else 1))
    if new == run_config.batch_size:
        return {}, None
    changes: dict[str, Any] = {"batch_size": new}
    note = (f"mini-batch {new} = M {m} x {new // m} examples per micro-batch (the preset's batch is "
            f"{run_config.batch_size}): the batch follows --m so that "
            + ("BatchNorm, computed per micro-batch, sees enough examples; the learning rate scales "
               "with the batch" if batchnorm else "every micro-batch has a row"))
    if run_config.steps is None and run_config.epochs is not None and options.get("steps") is None \
            and options.get("epochs") is None:
        epochs = round(run_config.epochs + 0.5 * math.log2(new / run_config.batch_size), 2)
        changes["epochs"] = epochs
        note += f", and the run is {epochs:g} epochs instead of {run_config.epochs:g} (fewer, larger steps)"
    return changes, note + ". Give --batch-size (and --epochs) to choose yourself"


def check_batchnorm_micro_batches(config: Any, *, uses_batchnorm: bool, allow: bool) -> None:
    """Refuse micro-batches too small for per-micro-batch BatchNorm, saying what to change."""
    replicas = getattr(config, "replicas", 1)       # each replica takes 1/R of the mini-batch
    per_micro = config.batch_size // (config.micro_batches * replicas)
    if uses_batchnorm and per_micro < MIN_BATCHNORM_MICRO_BATCH and not allow:
        suggestion = config.micro_batches * replicas * MIN_BATCHNORM_MICRO_BATCH
        with_r = f" and --replicas {replicas}" if replicas > 1 else ""
        raise ValueError(
            f"--batch-size {config.batch_size} with --m {config.micro_batches}{with_r} leaves {per_micro} "
            "examples "
            f"per micro-batch, too few for BatchNorm (normalized per micro-batch; below "
            f"{MIN_BATCHNORM_MICRO_BATCH} the model does not learn): use --batch-size {suggestion} or "
            f"more, or a smaller --m (at most "
            f"{max(1, config.batch_size // (replicas * MIN_BATCHNORM_MICRO_BATCH))}); "
            "--small-micro-batches runs it anyway")


def check_pipeline_fits(config: Any, layers: int, *, more_layers: str) -> None:
    """Refuse, before the data is read, a pipeline the model or the schedule cannot run: more cells
    (--k: cells, as ``GPipe(partitions=K)`` counts them, also for the schedules with two per
    process) than the model has layers, or a K and M the schedule does not take (the engine's own
    rules, its message in the command's options). `more_layers`: the option that gives the model
    more layers."""
    from gpipe_repro.commands.options import as_flags
    from gpipe_repro.engine.schedule import make_schedule

    if config.partitions > layers:
        raise ValueError(f"--k {config.partitions} cuts the model into {config.partitions} cells, and it "
                         f"has {layers} layers: use --k {layers} or less, or give the model more layers "
                         f"({more_layers})")
    split = config.split_backwards if isinstance(config.split_backwards, int) else None
    try:
        make_schedule(config.schedule, config.partitions, config.micro_batches, config.checkpoint,
                      split_backwards=split)
    except ValueError as e:
        raise ValueError(as_flags(str(e))) from None


def apply_pipeline_options(run_config: Any, options: dict[str, Any], *, task: str | None = None,
                           batchnorm: bool = False) -> Any:
    """The preset's RunConfig with the options given on the command line (None = not given).
    `--epochs` replaces a preset's step count; `--steps` wins over both. The run directory is
    resolved here (`gpipe_repro.train.run_dir.resolve_run_dir`): a fresh one unless told otherwise;
    with the `task`'s name (``Task.name``) it is also checked here, before the task builds its data.
    `batchnorm`: the model normalizes per micro-batch, so the batch follows `--m` by BatchNorm's rule
    (:func:`follow_micro_batches`)."""
    import dataclasses

    from gpipe_repro.engine.schedule import SCHEDULES, cells_per_process
    from gpipe_repro.train.run_dir import check_run_dir, resolve_run_dir

    followed, note = follow_micro_batches(run_config, options, batchnorm=batchnorm)
    if note is not None:
        options = {**options, **followed}
        print(f"note: {note}")
    if options.get("runtime") is None and options.get("schedule") in SCHEDULES \
            and cells_per_process(options["schedule"]) > 1 \
            and run_config.runtime == "distributed":
        # The preset pipelines with one process per cell; the training commands run schedules with
        # several stages per process (interleaved, zb-v) in one process only, so that choice wins
        # over the preset's.
        options = {**options, "runtime": "local"}
        print(f"note: --schedule {options['schedule']} runs with the local runtime (the preset's is "
              "distributed)")
    split = options.get("split_backwards")
    if split is not None and split != "auto":
        try:
            split = int(split)
        except ValueError:
            raise ValueError(f"--split-backwards takes a count (0 to --m) or auto, got {split!r}") from None
    config = run_config.replace(
        partitions=options["k"], micro_batches=options["m"], batch_size=options["batch_size"],
        steps=options["steps"], checkpoint=options["checkpoint"], schedule=options["schedule"],
        split_backwards=split,
        objective=options["objective"], partition_cost=options["partition_cost"],
        runtime=options["runtime"], launcher=options["launcher"], device=options["device"],
        threads=options["threads"], replicas=options.get("replicas"),
        optimizer=options["optimizer"], lr=options["lr"], seed=options["seed"],
        eval_every=options["eval_every"], save_every=options["save_every"],
        timeline_every=options["timeline_every"], name=options["name"], wandb=options["wandb"],
        timeout=options.get("timeout"), precision=options.get("precision"),
        clip_grad_norm=options.get("clip_grad_norm"))
    if options["launcher"] is not None and config.runtime == "local":
        raise ValueError(f"--launcher {options['launcher']} starts the stage processes of --runtime "
                         "distributed, and this run's runtime is local: add --runtime distributed, or "
                         "leave out --launcher")
    if options["epochs"] is not None and not options["epochs"] > 0:   # even where --steps wins
        raise ValueError(f"--epochs must be > 0, got {options['epochs']}")
    if options["epochs"] is not None and options["steps"] is None:
        config = dataclasses.replace(config, epochs=options["epochs"], steps=None)
    out = resolve_run_dir(config.name, out=options["out"], record=options.get("record", False),
                          resume=options["resume"])
    if task is not None:
        check_run_dir(out, task, resume=options["resume"],
                      overwrite=bool(options.get("overwrite") or options.get("record")))
    return dataclasses.replace(config, out_dir=str(out), resume=options["resume"],
                               progress=options["progress"],
                               overwrite=bool(options.get("overwrite") or options.get("record")))


def exit_code_of(summary: Any) -> int:
    """0 for a finished run; 128 + signal for one stopped by a signal (130: Ctrl-C, 143: SIGTERM),
    as a shell reports a process the signal killed; 1 for any other unfinished end."""
    if getattr(summary, "status", "finished") == "finished":
        return 0
    signum = getattr(summary, "signal", None)
    return 128 + signum if signum else 1


def interrupted_by(failure: Any) -> None:
    """A failed job whose stages the launcher had passed a signal to (a Ctrl-C they did not turn into
    a graceful stop) ends as that signal's interruption: one line, exit code 128 + signal."""
    signum = getattr(failure, "signal", None)
    if signum:
        import signal
        fail(f"interrupted by {signal.Signals(signum).name}: the stage processes stopped",
             code=128 + signum)


class Terminated(KeyboardInterrupt):
    """SIGTERM outside the training loop (which saves and exits on it): the run stops as on Ctrl-C,
    its claimed directory released, exit code 143 (a stub directory holding only the manifest was
    left otherwise, refused by --resume and by --out)."""


def run_task(build: Callable[[], tuple[Callable[[], Any], Any]]) -> Any:
    """Build (task factory, RunConfig) and train, turning the errors a user can fix into a one-line
    message and exit code 2 (a failed distributed job: 1, the launcher has named the failing rank)."""
    import signal
    import threading

    from gpipe_repro.data.images import DatasetUnavailableError
    from gpipe_repro.train.ranks import launch
    from gpipe_repro.train.run_dir import release_unused_claims

    def terminated(signum: int, frame: Any) -> None:   # before the loop's own handler, and after it
        raise Terminated("SIGTERM before training began or after it ended: nothing was saved")
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if main else None
    try:
        task_factory, run_config = build()
        summary = launch(task_factory, run_config)
    except (DatasetUnavailableError, FileExistsError, FileNotFoundError, NotImplementedError,
            ValueError, OSError) as e:
        fail(str(e))
    except RuntimeError as e:
        if type(e).__name__ == "JobFailed":
            interrupted_by(e)
            raise typer.Exit(1) from e
        fail(str(e))
    except FloatingPointError as e:    # the run diverged: not a usage error, exit code 1
        fail(str(e), code=1)
    except KeyboardInterrupt as e:     # a second Ctrl-C: say that nothing was saved (typer would not)
        fail(f"interrupted: {e}" if str(e) else "interrupted",
             code=128 + signal.SIGTERM if isinstance(e, Terminated) else 130)
    finally:   # a run refused or failed before writing anything leaves no empty runs/<name>-N
        if main:
            signal.signal(signal.SIGTERM, previous)
        release_unused_claims()
    code = exit_code_of(summary)
    if code:
        raise typer.Exit(code)
    return summary


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `message` as one error (not wrapped, not read as markup) and exit with `code` (2: a
    usage error)."""
    from rich.console import Console
    from rich.markup import escape
    console = Console(stderr=True, soft_wrap=True, highlight=False, emoji=False)   # "hf:llama:" stays text
    console.print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    group = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="Train a model through the pipeline (W&B logging, checkpoints, --resume).")
    app.add_typer(group, name="run")

    @group.command("amoebanet")
    @pipeline_options()
    def amoebanet(
        *,
        preset: str = typer.Option("cpu", help="cpu | paper | smoke; `--preset list` shows their values"),
        dataset: Optional[str] = typer.Option(None, help="mnist-sample | digits (offline) | cifar10 | "
                                              "cifar100 | hub:<repo id> | folder:<root>"),
        image_size: Optional[int] = typer.Option(None, help="square input size (resized)"),
        L: Optional[int] = typer.Option(None, "--L", help="normal cells"),
        F: Optional[int] = typer.Option(None, "--F", help="filters of the first stack"),
        genotype: Optional[str] = typer.Option(None, help="B (the paper's Table 4) or D"),
        pipeline: dict[str, Any],
        small_micro_batches: bool = typer.Option(
            False, "--small-micro-batches",
            help=f"allow fewer than {MIN_BATCHNORM_MICRO_BATCH} examples per micro-batch (BatchNorm)"),
    ) -> None:
        """AmoebaNet image classification (the paper's Table 4 recipe); presets: cpu, paper, smoke."""
        from gpipe_repro.train.tasks.image_classification import AmoebaNetTask, describe_presets
        from gpipe_repro.train.tasks.image_classification import preset as get_preset

        if preset == "list":
            print(describe_presets())
            return
        positive("--image-size", image_size, "pixels")
        positive("--L", L, "normal cells")
        positive("--F", F, "filters")

        def build() -> tuple[Any, Any]:
            run_config, task_config = get_preset(preset)
            task_config = task_config.replace(dataset=dataset, image_size=image_size, L=L, F=F,
                                              genotype=genotype)
            layers = task_config.layer_count()     # a bad genotype, L or F: refused before the data
            config = apply_pipeline_options(run_config, pipeline, task=AmoebaNetTask.name, batchnorm=True)
            check_pipeline_fits(config, layers, more_layers="--L")
            check_batchnorm_micro_batches(config, uses_batchnorm=True, allow=small_micro_batches)
            return functools.partial(AmoebaNetTask, task_config), config

        run_task(build)

    @group.command("transfer")
    def transfer(
        source: Optional[str] = typer.Option(None, "--from", show_default=False,
                                   help="the pretraining run directory (or a checkpoint file); default "
                                        "results/training/amoebanet-cpu, under $GPIPE_REPRO_RESULTS "
                                        "when set"),
        dataset: str = typer.Option("digits", help="the dataset to fine-tune on"),
        seeds: int = typer.Option(3, help="fine-tuning runs (seeds 0..N-1); the paper averages 5"),
        steps: int = typer.Option(120, help="fine-tuning steps per run"),
        batch_size: int = typer.Option(32, help=PIPELINE_HELP["batch_size"]),
        k: int = typer.Option(2, "--k", "-k", help=PIPELINE_HELP["k"]),
        m: int = typer.Option(4, "--m", "-m", help=PIPELINE_HELP["m"]),
        lr_per_32: float = typer.Option(0.008, help="fine-tuning learning rate per 32 examples"),
        baseline: bool = typer.Option(True, "--baseline/--no-baseline",
                                      help="also train from a random initialization"),
        out: Optional[str] = typer.Option(None, help="output directory (default: a fresh runs/transfer-N)"),
        record: bool = typer.Option(False, "--record", help="write the result of record, "
                                    "results/training/transfer"),
        overwrite: bool = typer.Option(False, "--overwrite", help="replace an earlier transfer's "
                                       "results in --out (only its own files)"),
        wandb: Optional[str] = typer.Option(None, help=PIPELINE_HELP["wandb"]),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="show the progress bar"),
    ) -> None:
        """The paper's transfer protocol (Table 4): new classifier, fine-tune all layers, mean over seeds."""
        from pathlib import Path

        from gpipe_repro.data.images import DatasetUnavailableError
        from gpipe_repro.train.run_dir import release_unused_claims, resolve_run_dir
        from gpipe_repro.train.tasks.transfer import TransferConfig, transfer_runs, write_transfer_report

        for flag, value in (("--seeds", seeds), ("--steps", steps), ("--batch-size", batch_size),
                            ("--k", k), ("--m", m)):
            if value < 1:
                fail(f"{flag} must be >= 1, got {value}")
        if not 0 < lr_per_32 < float("inf"):
            fail(f"--lr-per-32 must be a number > 0, got {lr_per_32}")
        try:
            out = str(resolve_run_dir("transfer", out=out, record=record, resume=False))
        except ValueError as e:
            fail(str(e))
        existing = sorted(p.name for p in Path(out).iterdir()) if Path(out).is_dir() else []
        if existing and "transfer.json" not in existing:
            fail(f"{out} is not empty and holds no earlier transfer results ({', '.join(existing[:4])}"
                 f"{', ...' if len(existing) > 4 else ''}); nothing was changed: give --out an empty or new "
                 "directory, or leave it out for a fresh runs/transfer-N")
        if existing and not (overwrite or record):
            fail(f"{out} holds an earlier transfer's results; nothing was changed: pass --overwrite to "
                 "replace them (only its own files), or give another --out")
        if source is None:
            from gpipe_repro.train.run_dir import record_dir
            source = str(record_dir() / "amoebanet-cpu")
        print(f"writing to {out}; pretrained weights from {source}; fine-tuning data: {dataset}")
        config = TransferConfig(source=source, dataset=dataset, seeds=tuple(range(seeds)), steps=steps,
                                batch_size=batch_size, partitions=k, micro_batches=m, lr_per_32=lr_per_32,
                                baseline=baseline, out_dir=out, wandb=wandb, progress=progress,
                                overwrite=overwrite or record)
        try:
            results = transfer_runs(config)
        except (DatasetUnavailableError, FileNotFoundError, ValueError, RuntimeError,
                KeyboardInterrupt) as e:
            release_unused_claims()     # a transfer that never started leaves no empty runs/transfer-N
            fail(str(e))
        json_path, md_path = write_transfer_report(results, config)
        for variant, r in results["runs"].items():
            print(f"{variant}: mean top-1 {r['mean_top1']:.2f}% (std {r['std_top1']:.2f}) over "
                  f"{len(r['seeds'])} seeds")
        print(f"wrote {json_path} and {md_path}")
