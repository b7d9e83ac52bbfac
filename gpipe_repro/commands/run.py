"""`gpipe-repro run <task>`: train a model through the pipeline, with logging, checkpoints and resume.

    gpipe-repro run amoebanet --preset cpu                   # ~5 min on 2 CPU cores, MNIST sample
    gpipe-repro run amoebanet --k 4 --m 32 --batch-size 128  # the preset's model, another pipeline
    gpipe-repro run amoebanet --preset cpu --resume          # continue a killed / Ctrl-C'd run
    gpipe-repro run amoebanet --preset paper                 # AmoebaNet-B (18, 512), 480x480, GPUs
    gpipe-repro run transfer --from results/training/amoebanet-cpu --dataset digits --seeds 3

One subcommand per task; every one builds a `Task` factory and a `RunConfig` and hands them to
`run_task`, which starts the one run loop (`gpipe_repro.train.loop.train`) in this process or, with
`--runtime distributed`, in K stage processes (`gpipe_repro.train.ranks.launch`). To add a task (e.g.
`transformer`), write its Task in `gpipe_repro/train/<task>.py` and add a function here decorated with
`@group.command("<task>")`, taking the shared options (`PIPELINE_HELP`) and calling `run_task`, as
`amoebanet` does. Options left out keep the preset's value.

    torchrun --nproc-per-node 4 $(which gpipe-repro) run amoebanet --k 4 --runtime distributed \
        --launcher torchrun                                  # one process per cell, under torchrun
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

import typer

# The pipeline / run options every task shares: name -> (flag, help). Declared once here so each task
# subcommand accepts them the same way (see `amoebanet` below for how they are used).
PIPELINE_HELP = {
    "k": "partitions K (cells, one per device)",
    "m": "micro-batches M per mini-batch",
    "batch_size": "examples per mini-batch (one synchronous update)",
    "steps": "optimizer steps (overrides --epochs)",
    "epochs": "epochs of the training set",
    "checkpoint": "re-materialization: always | except_last | never",
    "schedule": "pipeline schedule: gpipe | 1f1b",
    "objective": "partitioner objective: bottleneck | variance | greedy | equal",
    "partition_cost": "what the partitioner balances: params | time | flops | activations",
    "runtime": "local (one process) | distributed (one process per cell)",
    "launcher": "distributed runtime launcher: local | torchrun",
    "device": "cpu | cuda | auto",
    "threads": "torch CPU threads (default: the preset's, else one per core)",
    "optimizer": "override the task's optimizer: rmsprop | rmsprop-torch | sgd | adam | adamw",
    "lr": "override the task's peak learning rate",
    "seed": "seed of weights, data order, augmentation, dropout",
    "eval_every": "evaluate every N steps (0: only at the end)",
    "save_every": "save a checkpoint every N steps (0: only at the end and on Ctrl-C)",
    "timeline_every": "sample per-stage busy/idle and memory every N steps (0: never)",
    "name": "run name (directory results/training/<name>)",
    "out": "run directory (overrides results/training/<name>)",
    "wandb": "W&B mode: offline | online | disabled (default: $WANDB_MODE, else offline)",
}


def apply_pipeline_options(run_config: Any, options: dict[str, Any]) -> Any:
    """The preset's RunConfig with the options given on the command line (None = not given).
    `--epochs` replaces a preset's step count; `--steps` wins over both."""
    import dataclasses

    config = run_config.replace(
        partitions=options["k"], micro_batches=options["m"], batch_size=options["batch_size"],
        steps=options["steps"], checkpoint=options["checkpoint"], schedule=options["schedule"],
        objective=options["objective"], partition_cost=options["partition_cost"],
        runtime=options["runtime"], launcher=options["launcher"], device=options["device"],
        threads=options["threads"],
        optimizer=options["optimizer"], lr=options["lr"], seed=options["seed"],
        eval_every=options["eval_every"], save_every=options["save_every"],
        timeline_every=options["timeline_every"], name=options["name"], out_dir=options["out"],
        wandb=options["wandb"])
    if options["epochs"] is not None and options["steps"] is None:
        config = dataclasses.replace(config, epochs=options["epochs"], steps=None)
    return dataclasses.replace(config, resume=options["resume"], progress=options["progress"])


def run_task(build: Callable[[], tuple[Callable[[], Any], Any]]) -> Any:
    """Build (task factory, RunConfig) and train, turning the errors a user can fix into a one-line
    message and exit code 2 (a failed distributed job: 1, the launcher has named the failing rank)."""
    from gpipe_repro.data.images import DatasetUnavailableError
    from gpipe_repro.train.ranks import launch

    try:
        task_factory, run_config = build()
        return launch(task_factory, run_config)
    except (DatasetUnavailableError, FileExistsError, FileNotFoundError, NotImplementedError,
            ValueError) as e:
        fail(str(e))
    except RuntimeError as e:
        if type(e).__name__ == "JobFailed":
            raise typer.Exit(1) from e
        fail(str(e))


def fail(message: str) -> None:
    from rich.console import Console
    Console(stderr=True).print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


def register(app: typer.Typer) -> None:
    group = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="Train a model through the pipeline (W&B logging, checkpoints, --resume).")
    app.add_typer(group, name="run")

    @group.command("amoebanet")
    def amoebanet(
        preset: str = typer.Option("cpu", help="cpu | paper | smoke (see the presets list)"),
        dataset: Optional[str] = typer.Option(None, help="mnist-sample | digits (offline) | cifar10 | "
                                              "cifar100 | hub:<repo id> | folder:<root>"),
        image_size: Optional[int] = typer.Option(None, help="square input size (resized)"),
        L: Optional[int] = typer.Option(None, "--L", help="normal cells"),
        F: Optional[int] = typer.Option(None, "--F", help="filters of the first stack"),
        genotype: Optional[str] = typer.Option(None, help="B (the paper's Table 4) or D"),
        k: Optional[int] = typer.Option(None, "--k", "-k", help=PIPELINE_HELP["k"]),
        m: Optional[int] = typer.Option(None, "--m", "-m", help=PIPELINE_HELP["m"]),
        batch_size: Optional[int] = typer.Option(None, help=PIPELINE_HELP["batch_size"]),
        steps: Optional[int] = typer.Option(None, help=PIPELINE_HELP["steps"]),
        epochs: Optional[float] = typer.Option(None, help=PIPELINE_HELP["epochs"]),
        checkpoint: Optional[str] = typer.Option(None, help=PIPELINE_HELP["checkpoint"]),
        schedule: Optional[str] = typer.Option(None, help=PIPELINE_HELP["schedule"]),
        objective: Optional[str] = typer.Option(None, help=PIPELINE_HELP["objective"]),
        partition_cost: Optional[str] = typer.Option(None, help=PIPELINE_HELP["partition_cost"]),
        runtime: Optional[str] = typer.Option(None, help=PIPELINE_HELP["runtime"]),
        launcher: Optional[str] = typer.Option(None, help=PIPELINE_HELP["launcher"]),
        device: Optional[str] = typer.Option(None, help=PIPELINE_HELP["device"]),
        threads: Optional[int] = typer.Option(None, help=PIPELINE_HELP["threads"]),
        optimizer: Optional[str] = typer.Option(None, help=PIPELINE_HELP["optimizer"]),
        lr: Optional[float] = typer.Option(None, help=PIPELINE_HELP["lr"]),
        seed: Optional[int] = typer.Option(None, help=PIPELINE_HELP["seed"]),
        eval_every: Optional[int] = typer.Option(None, help=PIPELINE_HELP["eval_every"]),
        save_every: Optional[int] = typer.Option(None, help=PIPELINE_HELP["save_every"]),
        timeline_every: Optional[int] = typer.Option(None, help=PIPELINE_HELP["timeline_every"]),
        name: Optional[str] = typer.Option(None, help=PIPELINE_HELP["name"]),
        out: Optional[str] = typer.Option(None, help=PIPELINE_HELP["out"]),
        wandb: Optional[str] = typer.Option(None, help=PIPELINE_HELP["wandb"]),
        resume: bool = typer.Option(False, "--resume", help="continue from the run's latest checkpoint"),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="show the progress bar"),
    ) -> None:
        """AmoebaNet image classification (the paper's Table 4 recipe); presets: cpu, paper, smoke."""
        options = dict(locals())
        from gpipe_repro.train.tasks.image_classification import AmoebaNetTask
        from gpipe_repro.train.tasks.image_classification import preset as get_preset

        def build() -> tuple[Any, Any]:
            run_config, task_config = get_preset(preset)
            task_config = task_config.replace(dataset=dataset, image_size=image_size, L=L, F=F,
                                              genotype=genotype)
            return functools.partial(AmoebaNetTask, task_config), apply_pipeline_options(run_config, options)

        run_task(build)

    @group.command("transfer")
    def transfer(
        source: str = typer.Option("results/training/amoebanet-cpu", "--from",
                                   help="the pretraining run directory (or a checkpoint file)"),
        dataset: str = typer.Option("digits", help="the dataset to fine-tune on"),
        seeds: int = typer.Option(3, help="fine-tuning runs (seeds 0..N-1); the paper averages 5"),
        steps: int = typer.Option(120, help="fine-tuning steps per run"),
        batch_size: int = typer.Option(32),
        k: int = typer.Option(2, "--k", "-k", help=PIPELINE_HELP["k"]),
        m: int = typer.Option(4, "--m", "-m", help=PIPELINE_HELP["m"]),
        lr_per_32: float = typer.Option(0.008, help="fine-tuning learning rate per 32 examples"),
        baseline: bool = typer.Option(True, "--baseline/--no-baseline",
                                      help="also train from a random initialization"),
        out: str = typer.Option("results/training/transfer", help="output directory"),
        wandb: Optional[str] = typer.Option(None, help=PIPELINE_HELP["wandb"]),
        progress: bool = typer.Option(True, "--progress/--no-progress"),
    ) -> None:
        """The paper's transfer protocol (Table 4): new classifier, fine-tune all layers, mean over seeds."""
        from gpipe_repro.data.images import DatasetUnavailableError
        from gpipe_repro.train.tasks.transfer import TransferConfig, transfer_runs, write_transfer_report

        config = TransferConfig(source=source, dataset=dataset, seeds=tuple(range(seeds)), steps=steps,
                                batch_size=batch_size, partitions=k, micro_batches=m, lr_per_32=lr_per_32,
                                baseline=baseline, out_dir=out, wandb=wandb, progress=progress)
        try:
            results = transfer_runs(config)
        except (DatasetUnavailableError, FileNotFoundError, ValueError, RuntimeError,
                KeyboardInterrupt) as e:
            fail(str(e))
        json_path, md_path = write_transfer_report(results, config)
        for variant, r in results["runs"].items():
            print(f"{variant}: mean top-1 {r['mean_top1']:.2f}% (std {r['std_top1']:.2f}) over "
                  f"{len(r['seeds'])} seeds")
        print(f"wrote {json_path} and {md_path}")
