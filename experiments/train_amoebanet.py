"""AmoebaNet training results: the CPU preset run, K=1 vs K=4 loss curves, and the summary table.

    python -m experiments.train_amoebanet                 # all three (reuses a finished CPU run)
    python -m experiments.train_amoebanet --rerun         # train the CPU preset again first
    python -m experiments.train_amoebanet --steps 50      # length of the K=1 vs K=4 comparison

Writes results/training/:
- amoebanet-cpu/            the run itself (`gpipe-repro run amoebanet --preset cpu`): summary.json,
                            summary.md, curves.png, metrics.jsonl, W&B offline run (wandb/, not committed)
- k_equivalence.{json,png}  the same training with K=1 and K=4 (dropout, drop-path, augmentation on):
                            per-step losses and their largest difference
- training.{json,md}        the summary: accuracy and time of the CPU preset beside the paper's
                            ImageNet numbers (different dataset and model size: context, not a
                            comparison), the K-invariance check, and the transfer results if
                            `gpipe-repro run transfer` has written them
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import typer

from gpipe_repro.paper import IMAGENET, TRANSFER
from gpipe_repro.report.records import (
    markdown_table,
    measured,
    read_json,
    results_root,
    write_json,
    write_markdown,
)
from gpipe_repro.train.checkpoints import latest_checkpoint
from gpipe_repro.train.curves import plot_loss_comparison
from gpipe_repro.train.loop import train
from gpipe_repro.train.ranks import launch
from gpipe_repro.train.tasks.image_classification import AmoebaNetTask, preset

OUT = results_root() / "training"     # $GPIPE_REPRO_RESULTS/training when set


def cpu_run(rerun: bool) -> dict[str, Any]:
    """The CPU preset's summary.json (trained now if missing, unfinished or `rerun`)."""
    run, task = preset("cpu")
    summary_path = run.run_dir / "summary.json"
    if rerun or not summary_path.is_file() or read_json(summary_path).get("status") != "finished":
        resume = not rerun and latest_checkpoint(run.checkpoint_dir) is not None
        # as `make train-amoebanet` runs it: the preset's runtime (one process per cell on a
        # multi-core host) through the same launcher
        launch(functools.partial(AmoebaNetTask, task), dataclasses.replace(run, resume=resume))
    return read_json(summary_path)


def k_equivalence(steps: int) -> dict[str, Any]:
    """Train the CPU preset's model `steps` steps with K=1 and with K=4 (same M, seed, data)."""
    run, task = preset("cpu")
    task = dataclasses.replace(task, drop_path_ramp=False)   # drop-path at full strength from step 0
    curves: dict[str, tuple[list[int], list[float]]] = {}
    seconds = {}
    for k in (1, 4):
        config = dataclasses.replace(run, name=f"k-equivalence-k{k}", partitions=k, steps=steps,
                                     runtime="local",    # one process: the comparison is about K
                                     eval_every=0, save_every=0, timeline_every=0, wandb="disabled",
                                     out_dir=f"/tmp/gpipe-repro-k-equivalence/k{k}")
        summary = train(AmoebaNetTask(task), config)
        curves[f"K={k}"] = (list(range(steps)), summary.losses)
        seconds[f"K={k}"] = summary.train_seconds
    diffs = [abs(a - b) for a, b in zip(curves["K=1"][1], curves["K=4"][1])]
    plot_loss_comparison(curves, OUT / "k_equivalence.png",
                         f"AmoebaNet-B ({task.L}, {task.F}), M={run.micro_batches}, dropout {task.dropout}, "
                         f"drop-path {task.drop_path}: K=1 vs K=4")
    payload = {"kind": "k-equivalence", "steps": steps, "micro_batches": run.micro_batches,
               "batch_size": run.batch_size, "task": dataclasses.asdict(task),
               "losses": {label: c[1] for label, c in curves.items()},
               "max_abs_difference": measured(max(diffs)),
               "max_rel_difference": measured(max(d / abs(a) for d, a in zip(diffs, curves["K=1"][1]))),
               "train_seconds": {k: measured(v, unit="s") for k, v in seconds.items()}}
    write_json(OUT / "k_equivalence.json", payload)
    return payload


def report(cpu: dict[str, Any], equivalence: dict[str, Any]) -> None:
    task, run = cpu["config"]["task"], cpu["config"]["run"]
    transfer_path = OUT / "transfer" / "transfer.json"
    transfer = read_json(transfer_path) if transfer_path.is_file() else None
    rows = [
        ["CPU preset top-1 %", cpu["metrics"]["eval_top1"], f"AmoebaNet-B ({task['L']}, {task['F']}), "
         f"{task['dataset']} test split ({task['test_size']} images)"],
        ["CPU preset top-5 %", cpu["metrics"]["eval_top5"], ""],
        ["CPU preset training time", cpu["metrics"]["train_time"],
         f"{cpu['steps']} steps of {run['batch_size']}, K={run['partitions']}, M={run['micro_batches']}, "
         f"{run['threads'] or 'default'} thread(s)"],
        ["CPU preset wall time", cpu["metrics"]["wall_time"], "incl. evaluation and checkpoints"],
        ["CPU preset samples/s", cpu["metrics"]["samples_per_s"], ""],
        ["paper ImageNet top-1 %", IMAGENET["top1"], f"{IMAGENET['model']}, {IMAGENET['image_size']}px, "
         "ImageNet: context only"],
        ["paper ImageNet top-5 %", IMAGENET["top5"], ""],
        ["K=1 vs K=4 max |loss difference|", equivalence["max_abs_difference"],
         f"{equivalence['steps']} steps, dropout + drop-path + augmentation on"],
    ]
    if transfer is not None:
        for variant, r in transfer["results"].items():
            rows.append([f"transfer to {transfer['dataset']} ({variant}) mean top-1 %", r["mean_top1"],
                         f"{len(r['seeds'])} seeds, std {r['std_top1']['value']:.2f}"])
        rows.append(["paper transfer CIFAR-10 top-1 %", TRANSFER["cifar10"], "mean of 5 runs, 480px"])
    write_json(OUT / "training.json", {"kind": "training-summary", "cpu_preset": cpu["metrics"],
                                       "cpu_preset_config": cpu["config"], "k_equivalence": equivalence,
                                       "transfer": transfer, "paper": {"imagenet": IMAGENET,
                                                                        "transfer": TRANSFER}})
    write_markdown(OUT / "training.md", "\n".join([
        "# AmoebaNet training through the pipeline (measured)", "",
        "Every number is measured on this machine (2 CPU cores shared with other jobs; see the JSON files "
        "for the environment). The paper's numbers are for AmoebaNet-B (18, 512) on ImageNet at 480x480 "
        "on 4 accelerators: a different dataset and a model ~2000x larger, so they are context, not a "
        "target.", "",
        markdown_table(["what", "value", "notes"], rows, digits=4), "",
        "Curves of the CPU preset run: [amoebanet-cpu/curves.png](amoebanet-cpu/curves.png). "
        "The same training with K=1 and K=4 (one plot): [k_equivalence.png](k_equivalence.png).",
        "" if transfer is None else
        "Transfer protocol (Table 4): [transfer/transfer.md](transfer/transfer.md).",
        "", "Reproduce: `make train-amoebanet`, `gpipe-repro run transfer`, "
        "`python -m experiments.train_amoebanet`."]))


app = typer.Typer(add_completion=False)


@app.command()
def main(rerun: bool = typer.Option(False, "--rerun", help="train the CPU preset again"),
         steps: int = typer.Option(50, "--steps", min=1, help="steps of the K=1 vs K=4 comparison")) -> None:
    """The CPU preset run, K=1 vs K=4 loss curves, and the summary table."""
    cpu = cpu_run(rerun)
    equivalence = k_equivalence(steps)
    report(cpu, equivalence)
    print(f"wrote {OUT / 'training.md'}")


if __name__ == "__main__":
    app()
