"""Deep vs wide multilingual Transformers (the paper's section 5), at CPU scale.

    python -m experiments.deep_vs_wide                   # deep vs wide (reuses finished runs)
    python -m experiments.deep_vs_wide --rerun           # train both again
    python -m experiments.deep_vs_wide --steps 300       # a smaller budget (both models)
    python -m experiments.deep_vs_wide --large-batch     # also the large-batch study (3 more runs)

The paper compares a deep T(24, 8192, 16) with a wide T(12, 16384, 32), both 1.3B parameters: equal
on high-resource languages, the deep one far better on low-resource ones. Here: the same two shapes,
T(2L, H, A) and T(L, 2H, 2A), at d_model 128 with 64-channel heads (the paper's 1024 scaled down
8x; its A=16 heads fill d_model, so A=2 here), trained with the same budget (same steps, same
batches, hence same tokens, same seed) on 16 languages of the offline gettext corpus spanning 50k
to 100 training pairs. Everything else comes from `gpipe_repro/train/tasks/translation.py` and the
shared run loop.

Writes results/translation/:
- deep/, wide/                    the two runs (summary.json, summary.md, curves.png, metrics.jsonl;
                                  W&B offline run and checkpoints are not committed)
- deep_vs_wide.{json,md,png}      per-group BLEU beside the paper's claim; the BLEU gain of deep over
                                  wide against each language's training-set size
- large_batch.{json,md}           with --large-batch: BLEU and NLL at three batch sizes (M raised at a
                                  fixed micro-batch size) beside the paper's numbers
- report/                         the comparison logged as a W&B (offline) run, with its local files
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import typer

from experiments.deep_vs_wide_report import deep_vs_wide_markdown, plot_gains, plot_losses
from gpipe_repro.models.translation import count_non_embedding
from gpipe_repro.paper import CITATION, DEEP_VS_WIDE_CLAIM, LARGE_BATCH, TRANSLATION_MODELS
from gpipe_repro.report.records import (
    markdown_table,
    measured,
    read_json,
    results_root,
    write_json,
    write_markdown,
)
from gpipe_repro.train.checkpoints import latest_checkpoint
from gpipe_repro.train.config import RunConfig
from gpipe_repro.train.loop import train
from gpipe_repro.train.run_dir import clear_run
from gpipe_repro.train.tasks.translation import TranslationConfig, TranslationTask, preset
from gpipe_repro.train.tasks.translation_batches import TranslationBatches

OUT = results_root() / "translation"     # $GPIPE_REPRO_RESULTS/translation when set

# The comparison, declared: T(2L, H, A) "deep" vs T(L, 2H, 2A) "wide", on the CPU preset of
# `gpipe-repro run transformer` (whose model is the deep one): its languages, vocabulary, recipe
# and budget, with evaluation only at the end.
L, H, A = 2, 1024, 2
RUN, TASK = preset("cpu")
RUN = dataclasses.replace(RUN, eval_every=0, save_every=200, progress=True)
MODELS = {  # label: ((L, H, A), K, M) -- the paper put its deep model on 4 cells, the wide on 2
    "deep": ((2 * L, H, A), 4, RUN.micro_batches),
    "wide": ((L, 2 * H, 2 * A), 2, RUN.micro_batches),
}
# The paper's pair, for the table: T(24,8192,16) deep vs T(12,16384,32) wide.
PAPER_DEEP, PAPER_WIDE = "T(24,8192,16)", "T(12,16384,32)"

# The large-batch study: one model, M raised at a fixed micro-batch size (the paper: 260K, 1M and
# 4M tokens per batch, 4x apart).
LARGE_BATCH_MODEL, LARGE_BATCH_K = (2 * L, H, A), 4
LARGE_BATCH_MICRO, LARGE_BATCH_M, LARGE_BATCH_STEPS = 8, (2, 8, 32), 300


def shape_name(shape: tuple[int, int, int]) -> str:
    return f"T({shape[0]},{shape[1]},{shape[2]})"


def with_shape(task: TranslationConfig, shape: tuple[int, int, int]) -> TranslationConfig:
    return dataclasses.replace(task, L=shape[0], H=shape[1], A=shape[2])


def run_model(label: str, task: TranslationConfig, run: RunConfig, rerun: bool) -> dict[str, Any]:
    """Train (or reuse a finished run with the same settings; an unfinished one is resumed) and
    return its summary.json."""
    summary_path = run.run_dir / "summary.json"
    if summary_path.is_file() and not rerun:
        summary = read_json(summary_path)
        same = (all(summary["config"]["task"].get(k) == v for k, v in task.to_dict().items())
                and all(summary["config"]["run"].get(k) == getattr(run, k)
                        for k in ("steps", "batch_size", "partitions", "micro_batches", "seed")))
        if summary.get("status") == "finished" and same:
            print(f"{label}: reusing the finished run in {run.run_dir}")
            return summary
        rerun = summary.get("status") == "finished"      # finished with other settings: replace it
    if rerun and run.run_dir.is_dir():
        clear_run(run.run_dir)         # asked for (--rerun): start from scratch; only the run's own files
    print(f"{label}: training {shape_name((task.L, task.H, task.A))} in {run.run_dir}")
    resume = not rerun and latest_checkpoint(run.checkpoint_dir) is not None
    train(TranslationTask(task), dataclasses.replace(run, resume=resume))
    return read_json(summary_path)


def parameter_counts(task: TranslationTask) -> dict[str, int]:
    layers = task.build_layers()
    return {"total": sum(p.numel() for p in layers.parameters()),
            "non_embedding": count_non_embedding(layers)}


def tokens_per_batch(task: TranslationTask, batch_size: int, steps: int, seed: int) -> float:
    """Mean target tokens per mini-batch of the stream every run here draws (same seed, same batches)."""
    stream = TranslationBatches(task.train_data, batch_size, seed, task.settings.temperature,
                                task.tokenizer.pad_id, task.tokenizer.bos_id)
    for _ in range(steps):
        stream.next_batch()
    return stream.tokens / steps


def fixed_steps(run: RunConfig) -> int:
    """The run's step budget: the comparisons here need one (a run given in epochs has none)."""
    if run.steps is None:
        raise ValueError(f"run {run.name!r} has no step budget: give it steps (--steps), not epochs")
    return run.steps


# ----------------------------------------------------------------------------- deep vs wide

def deep_vs_wide(out: Path = OUT, task: TranslationConfig = TASK, run: RunConfig = RUN,
                 models: dict[str, tuple[tuple[int, int, int], int, int]] = MODELS,
                 rerun: bool = False) -> dict[str, Any]:
    """Train `models` (label: ((L, H, A), K, M)) with one budget; write the comparison to `out`."""
    steps = fixed_steps(run)
    summaries, counts, shapes = {}, {}, {}
    for label, (shape, k, m) in models.items():
        counts[label] = parameter_counts(TranslationTask(with_shape(task, shape)))
        shapes[label] = shape
        print(f"{label} {shape_name(shape)} at d_model {task.d_model}: {counts[label]['total']:,} "
              f"parameters ({counts[label]['non_embedding']:,} without the embeddings), K={k}, M={m}")
    gap = abs(counts["deep"]["total"] - counts["wide"]["total"]) / counts["wide"]["total"]
    if gap > 0.01:
        raise ValueError(f"deep and wide differ by {100 * gap:.2f}% in parameters: choose shapes "
                         "within 1%")
    for label, (shape, k, m) in models.items():
        summaries[label] = run_model(label, with_shape(task, shape),
                                     dataclasses.replace(run, name=f"deep-vs-wide-{label}",
                                                         out_dir=str(out / label), partitions=k,
                                                         micro_batches=m), rerun)
    reference = TranslationTask(with_shape(task, models["deep"][0]))
    tokens = tokens_per_batch(reference, run.batch_size, steps, run.seed)
    result = comparison(summaries, counts, shapes, tokens, run)
    write_json(out / "deep_vs_wide.json", result)
    plot_gains(result, out / "deep_vs_wide.png")
    plot_losses({label: Path(s["run_dir"]) / "metrics.jsonl" for label, s in summaries.items()},
                {label: shape_name(shape) for label, shape in shapes.items()},
                out / "deep_vs_wide_loss.png")
    write_markdown(out / "deep_vs_wide.md", deep_vs_wide_markdown(result))
    return result


def comparison(summaries: dict[str, dict[str, Any]], counts: dict[str, dict[str, int]],
               shapes: dict[str, tuple[int, int, int]], tokens: float, run: RunConfig) -> dict[str, Any]:
    task = summaries["deep"]["config"]["task"]
    train_sizes, groups, eval_sizes = task["train_sizes"], task["groups"], task["eval_sizes"]
    steps = fixed_steps(run)
    models = {}
    for label, summary in summaries.items():
        ev = summary["eval"]
        models[label] = {
            "shape": shape_name(shapes[label]), "L": shapes[label][0], "H": shapes[label][1],
            "A": shapes[label][2], "d_model": task["d_model"], "head_dim": task["head_dim"],
            "params": measured(counts[label]["total"]),
            "params_non_embedding": measured(counts[label]["non_embedding"]),
            "partitions": summary["config"]["run"]["partitions"],
            "micro_batches": summary["config"]["run"]["micro_batches"], "balance": summary["balance"],
            "bleu_high": measured(ev["bleu_high"]), "bleu_low": measured(ev["bleu_low"]),
            "bleu_all": measured(ev["bleu"]),
            "bleu_high_mean": measured(ev["bleu_high_mean"]), "bleu_low_mean": measured(ev["bleu_low_mean"]),
            "nll": measured(ev["nll"], unit="nats/token"),
            "final_train_loss": measured(summary["final_train_loss"]),
            "train_time": measured(summary["train_seconds"], unit="s"),
            "wall_time": measured(summary["wall_seconds"], unit="s"),
            "bleu_by_language": {lang: measured(ev[f"bleu_{lang}"]) for lang in train_sizes},
            "run_dir": summary["run_dir"],
        }
    languages = {lang: {"train_pairs": train_sizes[lang], "group": groups[lang],
                        "test_sentences_scored": eval_sizes.get(lang, 0),
                        "bleu_gain_deep_over_wide": measured(
                            models["deep"]["bleu_by_language"][lang]["value"]
                            - models["wide"]["bleu_by_language"][lang]["value"])}
                 for lang in sorted(train_sizes, key=lambda x: -train_sizes[x])}
    gains = {g: measured(models["deep"][f"bleu_{g}"]["value"] - models["wide"][f"bleu_{g}"]["value"])
             for g in ("high", "low", "all")}
    return {
        "kind": "deep-vs-wide",
        "claim": DEEP_VS_WIDE_CLAIM, "citation": CITATION,
        "paper": {"deep": {"shape": PAPER_DEEP, "params": TRANSLATION_MODELS[PAPER_DEEP][3],
                           "partitions": TRANSLATION_MODELS[PAPER_DEEP][4],
                           "average_bleu_figure_1b": TRANSLATION_MODELS[PAPER_DEEP][5]},
                  "wide": {"shape": PAPER_WIDE, "params": TRANSLATION_MODELS[PAPER_WIDE][3],
                           "partitions": TRANSLATION_MODELS[PAPER_WIDE][4],
                           "average_bleu_figure_1b": TRANSLATION_MODELS[PAPER_WIDE][5]},
                  "note": "average BLEU over 102 languages read off Figure 1b (approximate)"},
        "budget": {"steps": steps, "sentences_per_batch": run.batch_size, "seed": run.seed,
                   "target_tokens_per_batch": measured(tokens),
                   "target_tokens_total": measured(tokens * steps),
                   "sentences_drawn": steps * run.batch_size,
                   "training_pairs": sum(train_sizes.values()),
                   "threads": run.threads, "checkpoint": run.checkpoint,
                   "same_batches": "both runs draw the identical batch stream (same seed and batch size)"},
        "task": task, "models": models, "languages": languages,
        "bleu_gain_deep_over_wide": gains,
    }


def large_batch(out: Path = OUT, task: TranslationConfig = TASK, run: RunConfig = RUN,
                shape: tuple[int, int, int] = LARGE_BATCH_MODEL, partitions: int = LARGE_BATCH_K,
                micro: int = LARGE_BATCH_MICRO, ms: tuple[int, ...] = LARGE_BATCH_M,
                steps: int = LARGE_BATCH_STEPS, rerun: bool = False) -> dict[str, Any]:
    """One model at len(ms) batch sizes: M micro-batches of `micro` sentences each, `steps` steps."""
    rows, tokens = {}, {}
    config = with_shape(task, shape)
    reference = TranslationTask(config)
    for m in ms:
        batch = m * micro
        settings = dataclasses.replace(run, name=f"large-batch-m{m}", out_dir=str(out / f"large-batch-m{m}"),
                                       partitions=partitions, micro_batches=m, batch_size=batch,
                                       steps=steps, save_every=max(1, steps // 4))
        rows[m] = run_model(f"M={m}", config, settings, rerun)
        tokens[m] = tokens_per_batch(reference, batch, steps, run.seed)
    paper = sorted(LARGE_BATCH.items())
    runs: list[dict[str, Any]] = [
        {"micro_batches": m, "sentences_per_batch": m * micro,
         "target_tokens_per_batch": measured(tokens[m]),
         "bleu": measured(s["eval"]["bleu"], paper=paper[i][1][0]),
         "bleu_high": measured(s["eval"]["bleu_high"]), "bleu_low": measured(s["eval"]["bleu_low"]),
         "nll": measured(s["eval"]["nll"], paper=paper[i][1][1], unit="nats/token"),
         "train_time": measured(s["train_seconds"], unit="s"), "run_dir": s["run_dir"]}
        for i, (m, s) in enumerate(rows.items())]
    result = {
        "kind": "large-batch", "citation": CITATION,
        "model": shape_name(shape), "d_model": task.d_model, "partitions": partitions,
        "micro_batch_sentences": micro, "steps": steps,
        "paper": {"setting": "German-English, Transformer Big; tokens per batch -> (BLEU, NLL)",
                  "rows": [{"tokens_per_batch": t, "bleu": b, "nll": n} for t, (b, n) in paper]},
        "runs": runs,
    }
    write_json(out / "large_batch.json", result)
    table = [[f"M={x['micro_batches']} ({x['sentences_per_batch']} sentences, "
              f"{x['target_tokens_per_batch']['value']:.0f} tokens)", x["bleu"], x["nll"],
              f"{paper[i][0]:,} tokens", x["train_time"]] for i, x in enumerate(runs)]
    write_markdown(out / "large_batch.md", "\n".join([
        "# Larger batches (measured, CPU scale)", "",
        f"The paper ({CITATION}) trained Transformer Big on German-English with 260K, 1M and 4M tokens "
        "per batch and saw BLEU and NLL improve with the batch size. Here: "
        f"{shape_name(shape)} at d_model {task.d_model} on the deep-vs-wide languages, K={partitions}, "
        f"{micro} sentences per micro-batch (the same memory per cell), M raised to make "
        f"the batch 4x larger each time, {steps} steps each (so the larger batches also see more data; "
        "the paper does not say how long its three runs were), the same learning-rate schedule. "
        "BLEU pooled over all languages (greedy); NLL per target token on the same test sentences. "
        "Paper values in parentheses, in the row of "
        "the same rank.", "",
        markdown_table(["batch", "BLEU (paper)", "NLL (paper)", "paper batch", "train time (s)"], table,
                       digits=3), "",
        "Reproduce: `python -m experiments.deep_vs_wide --large-batch`."]))
    return result


# ----------------------------------------------------------------------------- W&B

def log_report(result: dict[str, Any], large: dict[str, Any] | None, out: Path = OUT) -> None:
    """The comparison as one W&B run (offline by default) plus its local files in report/."""
    from gpipe_repro.report.wandb_log import RunLogger

    with RunLogger("gpipe-repro", {"experiment": "deep-vs-wide", "budget": result["budget"],
                                   "models": {k: v["shape"] for k, v in result["models"].items()}},
                   dir=out / "report", name="deep-vs-wide", group="transformer",
                   tags=["deep-vs-wide", "translation"]) as logger:
        logger.log_table("bleu_by_language", ["language", "group", "train_pairs", "deep", "wide", "gain"],
                         [[lang, x["group"], x["train_pairs"],
                           result["models"]["deep"]["bleu_by_language"][lang]["value"],
                           result["models"]["wide"]["bleu_by_language"][lang]["value"],
                           x["bleu_gain_deep_over_wide"]["value"]]
                          for lang, x in result["languages"].items()],
                         method="measured")
        logger.log_image("bleu_gain_vs_training_size", out / "deep_vs_wide.png")
        summary = {f"{label}/{key}": m[key]["value"] for label, m in result["models"].items()
                   for key in ("bleu_high", "bleu_low", "bleu_all", "nll", "params", "train_time")}
        summary.update({f"gain/{g}": v["value"] for g, v in result["bleu_gain_deep_over_wide"].items()})
        if large is not None:
            logger.log_table("large_batch", ["M", "sentences", "tokens", "bleu", "nll"],
                             [[x["micro_batches"], x["sentences_per_batch"],
                               x["target_tokens_per_batch"]["value"], x["bleu"]["value"], x["nll"]["value"]]
                              for x in large["runs"]], method="measured")
        logger.summary(summary)


app = typer.Typer(add_completion=False)


@app.command()
def main(steps: int = typer.Option(RUN.steps, "--steps", min=1, help="training steps of each model"),
         rerun: bool = typer.Option(False, "--rerun", help="train again even if finished runs exist"),
         large_batch_study: bool = typer.Option(False, "--large-batch", help="also run the large-batch "
                                                "study"),
         large_batch_steps: int = typer.Option(LARGE_BATCH_STEPS, "--large-batch-steps", min=1,
                                               help="training steps of each large-batch run")) -> None:
    """Deep vs wide multilingual Transformers (the paper's section 5), at CPU scale."""
    result = deep_vs_wide(OUT, TASK, dataclasses.replace(RUN, steps=steps), MODELS, rerun)
    large = (large_batch(OUT, TASK, RUN, steps=large_batch_steps, rerun=rerun)
             if large_batch_study else None)
    if large is None and (OUT / "large_batch.json").is_file():
        large = read_json(OUT / "large_batch.json")
    log_report(result, large)
    for g in ("high", "low", "all"):
        print(f"BLEU {g}: deep {result['models']['deep'][f'bleu_{g}']['value']:.2f}, wide "
              f"{result['models']['wide'][f'bleu_{g}']['value']:.2f}")
    print(f"wrote {OUT / 'deep_vs_wide.md'}"
          + (f" and {OUT / 'large_batch.md'}" if large_batch_study else ""))


if __name__ == "__main__":
    app()
