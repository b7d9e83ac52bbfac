"""The transfer-learning protocol of the paper's Table 4, at a size this machine can run.

The paper: take the ImageNet-trained AmoebaNet-B (18, 512), replace the softmax classifier by a new
randomly initialized one for the target dataset, fine-tune *all* layers at 480x480 with random flips
and cutout, and report the mean test accuracy of 5 fine-tuning runs (CIFAR-10 99.0%, CIFAR-100 91.3%,
...; `paper.TRANSFER`).

Here: pretrain on the offline MNIST sample (`gpipe-repro run amoebanet --preset cpu`), then fine-tune
on scikit-learn's 8x8 digits upsampled to the pretraining resolution (28x28), with a new classifier,
over several seeds, and report the mean and spread. The same runs from a random initialization give
the baseline that says whether pretraining helped. The datasets, resolution and model size differ
from the paper's, so the numbers are comparable in protocol only, not in value.

Loading weights across partitionings: a checkpoint holds GPipe's state (`cells.<cell>.<layer in
cell>.<name>`) and the balance it was cut with; :func:`layer_state_dict` maps it back to the flat
layer names, so a model pretrained with K=4 can be fine-tuned with K=2 (or K=1).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpipe_repro.train.checkpoints import latest_checkpoint, load_checkpoint
from gpipe_repro.train.run_dir import record_dir

# The classifier layers a transfer run re-initializes: every fully connected layer of AmoebaNet is one
# (the main head's and the auxiliary head's); everything else is transferred.
CLASSIFIER_TYPES = (nn.Linear,)


def pretrained_checkpoint(source: str | os.PathLike[str]) -> Path:
    """A checkpoint file from a run directory (its latest), a checkpoints directory, or a file."""
    source = Path(source)
    if source.is_file():
        return source
    for directory in (source / "checkpoints", source):
        found = latest_checkpoint(directory)
        if found is not None:
            return found
    raise FileNotFoundError(f"no checkpoint in {source}: give --from a pretraining run directory (e.g. "
                            "runs/amoebanet-cpu, made by `gpipe-repro run amoebanet --preset cpu`, or "
                            "results/training/amoebanet-cpu, by `make train-amoebanet`), its "
                            "checkpoints/ directory or a step-*.pt file")


def layer_state_dict(checkpoint: dict[str, Any], layer_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The pipeline's weights in a checkpoint, keyed by the flat model's names (`head.fc.weight`)."""
    pipeline = checkpoint["state"]["pipeline"]
    offsets = [sum(pipeline["balance"][:c]) for c in range(len(pipeline["balance"]))]
    if sum(pipeline["balance"]) != len(layer_names):
        raise ValueError(f"the checkpoint's model has {sum(pipeline['balance'])} layers, this one "
                         f"{len(layer_names)}: build the same architecture (L, F, genotype, aux head)")
    out: dict[str, torch.Tensor] = {}
    for key, value in pipeline["model"].items():
        _, cell, index, rest = key.split(".", 3)
        out[f"{layer_names[offsets[int(cell)] + int(index)]}.{rest}"] = value
    return out


def classifier_prefixes(layers: nn.Module) -> list[str]:
    return [name for name, m in layers.named_modules() if isinstance(m, CLASSIFIER_TYPES)]


def load_pretrained(layers: nn.Sequential, source: str | os.PathLike[str]) -> list[str]:
    """Load every pretrained weight into `layers` except the classifiers (left as initialized).

    Returns the names of the re-initialized classifier modules. Fails, naming the first mismatches,
    when the checkpoint's architecture differs.
    """
    checkpoint = load_checkpoint(pretrained_checkpoint(source))
    pretrained = layer_state_dict(checkpoint, list(layers._modules))
    classifiers = classifier_prefixes(layers)

    def is_classifier(key: str) -> bool:
        return any(key.startswith(prefix + ".") for prefix in classifiers)

    own = layers.state_dict()
    missing = [k for k in own if not is_classifier(k) and k not in pretrained]
    wrong = [f"{k} {tuple(pretrained[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
             if not is_classifier(k) and k in pretrained and pretrained[k].shape != v.shape]
    if missing or wrong:
        raise ValueError(f"the pretrained checkpoint does not fit this model (missing {missing[:3]}, "
                         f"shape mismatches {wrong[:3]}): fine-tune the same architecture and input "
                         "channels as the pretraining run")
    layers.load_state_dict({**own, **{k: v for k, v in pretrained.items() if not is_classifier(k)}})
    return classifiers


def pretraining_config(source: str | os.PathLike[str]) -> dict[str, Any]:
    """The task settings the checkpoint was trained with (L, F, genotype, image size, ...); ValueError
    for a checkpoint of another task's run (a Transformer's: the transfer fine-tunes AmoebaNet)."""
    found = pretrained_checkpoint(source)
    task = dict(load_checkpoint(found)["extra"].get("task") or {})
    if "input_shape" not in task or "genotype" not in task:
        raise ValueError(f"{found} is not an AmoebaNet run's checkpoint (its settings: "
                         f"{', '.join(sorted(task)[:6]) or 'none'}): give --from a run of "
                         "`gpipe-repro run amoebanet`")
    return task


# ----------------------------------------------------------------------------- the protocol

@dataclasses.dataclass
class TransferConfig:
    # the pretraining run: results/training/amoebanet-cpu (under $GPIPE_REPRO_RESULTS when set)
    source: str = dataclasses.field(default_factory=lambda: str(record_dir() / "amoebanet-cpu"))
    dataset: str = "digits"
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 120
    batch_size: int = 32
    partitions: int = 2
    micro_batches: int = 4
    lr_per_32: float = 0.008          # fine-tuning: about half the pretraining rate
    warmup_epochs: float = 0.25       # then cosine to 0 (a short run has no room for epoch decays)
    baseline: bool = True            # also train from a random initialization
    out_dir: str = "results/training/transfer"
    wandb: str | None = None          # None: $WANDB_MODE, else offline
    progress: bool = True
    overwrite: bool = False           # replace finished runs of an earlier transfer in out_dir
    threads: int | None = 1           # as the CPU preset: two threads on two busy cores crawl


def transfer_runs(config: TransferConfig) -> dict[str, Any]:
    """Fine-tune (and train from scratch) once per seed; returns the per-seed and mean accuracies."""
    from gpipe_repro.train.config import RunConfig
    from gpipe_repro.train.loop import train
    from gpipe_repro.train.tasks.image_classification import AmoebaNetConfig, AmoebaNetTask

    checkpoint = pretrained_checkpoint(config.source)
    pre = pretraining_config(checkpoint)
    size = pre["input_shape"][1]
    variants: dict[str, str | None] = {"pretrained": str(checkpoint)}
    if config.baseline:
        variants["scratch"] = None
    results: dict[str, Any] = {"pretrained_from": str(checkpoint), "pretraining": pre, "runs": {}}
    for variant, init_from in variants.items():
        rows = []
        for seed in config.seeds:
            task = AmoebaNetTask(AmoebaNetConfig(
                dataset=config.dataset, image_size=size, genotype=pre["genotype"], L=pre["L"], F=pre["F"],
                dropout=pre["dropout"], drop_path=pre["drop_path"], aux_head=pre["aux_head"],
                bn_momentum=pre["bn_momentum"], lr_per_32=config.lr_per_32, lr_schedule="cosine",
                warmup_epochs=config.warmup_epochs, init_from=init_from))
            run = RunConfig(name=f"transfer-{config.dataset}-{variant}-seed{seed}",
                            out_dir=str(Path(config.out_dir) / f"{variant}-seed{seed}"),
                            partitions=config.partitions, micro_batches=config.micro_batches,
                            batch_size=config.batch_size, steps=config.steps, seed=seed, lr=None,
                            wandb=config.wandb, progress=config.progress, timeline_every=0,
                            threads=config.threads, overwrite=config.overwrite)
            summary = train(task, run)
            if summary.status != "finished":
                raise KeyboardInterrupt(f"transfer stopped during {run.name} (saved in {run.run_dir})")
            rows.append({"seed": seed, "top1": summary.eval["top1"], "top5": summary.eval["top5"],
                         "train_seconds": summary.train_seconds})
        top1 = [r["top1"] for r in rows]
        results["runs"][variant] = {
            "seeds": rows, "mean_top1": statistics.fmean(top1),
            "std_top1": statistics.stdev(top1) if len(top1) > 1 else 0.0}
    return results



def write_transfer_report(results: dict[str, Any], config: TransferConfig) -> tuple[Path, Path]:
    """transfer.json (measured records beside the paper's Table 4) and transfer.md."""
    from gpipe_repro.paper import CITATION, TRANSFER
    from gpipe_repro.report.records import markdown_table, measured, write_json, write_markdown

    out = Path(config.out_dir)
    pre = results["pretraining"]
    runs = results["runs"]
    note = (f"Datasets differ from the paper's: pretraining on the offline MNIST sample "
            f"({pre['train_size']} images) instead of ImageNet, fine-tuning on scikit-learn digits "
            f"(8x8, upsampled to {pre['input_shape'][1]}x{pre['input_shape'][1]}) instead of CIFAR-10 etc. "
            f"at 480x480, with AmoebaNet-{pre['genotype']} ({pre['L']}, {pre['F']}) instead of (18, 512). "
            "Only the protocol (new random classifier, all layers fine-tuned, crop/cutout augmentation, "
            "mean over seeds) is the paper's; the values are not comparable.")
    records = {variant: {"mean_top1": measured(r["mean_top1"], unit="%"),
                         "std_top1": measured(r["std_top1"], unit="%"),
                         "seeds": r["seeds"]} for variant, r in runs.items()}
    payload = {"kind": "transfer", "dataset": config.dataset, "protocol": dataclasses.asdict(config),
               "pretrained_from": results["pretrained_from"], "pretraining": pre, "results": records,
               "paper": {"citation": CITATION, "transfer_top1": TRANSFER,
                         "protocol": "AmoebaNet-B (18, 512) pretrained on ImageNet, new softmax, "
                                     "all layers fine-tuned at 480x480, flip + cutout, mean of 5 runs"},
               "note": note}
    json_path = write_json(out / "transfer.json", payload)
    ours = [[f"{config.dataset} ({variant}, ours)", r["mean_top1"], r["std_top1"], len(r["seeds"])]
            for variant, r in runs.items()]
    paper = [[f"{name} (paper)", value, None, 5] for name, value in TRANSFER.items()]
    table = markdown_table(["dataset", "mean top-1 %", "std", "runs"], ours + paper, digits=4)
    per_seed = markdown_table(["variant", "seed", "top-1 %", "top-5 %", "train s"],
                              [[v, s["seed"], s["top1"], s["top5"], s["train_seconds"]]
                               for v, r in runs.items() for s in r["seeds"]], digits=4)
    md_path = write_markdown(out / "transfer.md", "\n".join([
        "# Transfer learning (Table 4 protocol), measured", "",
        f"Pretrained: `{results['pretrained_from']}`. Fine-tuning: {config.steps} steps, batch "
        f"{config.batch_size}, K={config.partitions}, M={config.micro_batches}, RMSProp "
        f"{config.lr_per_32} per 32 examples, cosine decay; `scratch` is the same training from a random "
        "initialization.", "", table, "", per_seed, "", f"Note: {note}"]))
    return json_path, md_path
