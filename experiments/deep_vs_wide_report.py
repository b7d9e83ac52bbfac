"""The deep-vs-wide comparison's page and figures (experiments/deep_vs_wide.py runs it)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from gpipe_repro.report.records import markdown_table


def deep_vs_wide_markdown(r: dict[str, Any]) -> str:
    deep, wide, b = r["models"]["deep"], r["models"]["wide"], r["budget"]
    groups = {g: [lang for lang, x in r["languages"].items() if x["group"] == g] for g in ("high", "low")}
    pairs = {g: sum(r["languages"][lang]["train_pairs"] for lang in groups[g]) for g in groups}
    sentences = {g: sum(r["languages"][lang]["test_sentences_scored"] for lang in groups[g]) for g in groups}
    claim_high, claim_low = "about equal", "deep wins by large margins (+15 vs +8..10 over baselines)"
    rows = []
    for g, claim in (("high", claim_high), ("low", claim_low)):
        rows.append([f"{g}-resource ({len(groups[g])} language(s), {pairs[g]:,} training pairs, "
                     f"{sentences[g]} test sentences)", deep[f"bleu_{g}"], wide[f"bleu_{g}"],
                     r["bleu_gain_deep_over_wide"][g], claim])
    rows.append(["all languages", deep["bleu_all"], wide["bleu_all"], r["bleu_gain_deep_over_wide"]["all"],
                 f"deep {r['paper']['deep']['average_bleu_figure_1b']} vs wide "
                 f"{r['paper']['wide']['average_bleu_figure_1b']} average BLEU (Figure 1b, approx.)"])
    models = [[label, m["shape"], m["params"], m["params_non_embedding"], m["partitions"], m["micro_batches"],
               m["nll"], m["final_train_loss"], m["train_time"], m["wall_time"]]
              for label, m in r["models"].items()]
    languages = [[lang, x["group"], x["train_pairs"], x["test_sentences_scored"],
                  deep["bleu_by_language"][lang], wide["bleu_by_language"][lang],
                  x["bleu_gain_deep_over_wide"]]
                 for lang, x in r["languages"].items()]
    verdict = verdict_text(r)
    return "\n".join([
        "# Deep vs wide multilingual Transformers (measured, CPU scale)", "",
        f"Paper ({r['citation']}): {r['claim']}", "",
        f"Here: deep {deep['shape']} vs wide {wide['shape']} at d_model {deep['d_model']} "
        f"({deep['head_dim']}-channel heads), {deep['params']['value']:,} vs "
        f"{wide['params']['value']:,} parameters; both trained "
        f"{b['steps']} steps of {b['sentences_per_batch']} sentences (on average "
        f"{b['target_tokens_per_batch']['value']:.0f} target tokens per batch, "
        f"{b['target_tokens_total']['value']:,.0f} in all, {b['sentences_drawn']:,} sentences drawn = "
        f"{b['sentences_drawn'] / b['training_pairs']:.2f} epoch of the {b['training_pairs']:,} training "
        f"pairs; the same batches for both, seed {b['seed']}) on "
        f"{len(r['languages'])} languages of the {r['task']['corpus']} corpus (many-to-English), "
        f"{b['threads']} CPU thread each on a shared 2-core machine. BLEU: sacrebleu on greedy "
        "translations, pooled over each group's test sentences (groups split at the median "
        "training-set size). All numbers measured; the paper's models are 10^3 times larger and "
        "trained on 25B examples, so its numbers are context, not a target.", "",
        markdown_table(["BLEU", f"deep {deep['shape']}", f"wide {wide['shape']}", "deep - wide",
                        "paper (1.3B models)"], rows, digits=3), "",
        f"**Outcome at this scale:** {verdict}", "",
        "![BLEU gain of deep over wide against training-set size](deep_vs_wide.png)", "",
        "![training loss of both models](deep_vs_wide_loss.png)", "",
        markdown_table(["model", "shape", "params", "params w/o embeddings", "K", "M", "test NLL",
                        "final train loss", "train time (s)", "wall time (s)"], models, digits=4), "",
        "Per language (test sentences scored: evenly spaced over the test split, at most "
        f"{r['task']['eval_sentences']} per language; low-resource scores rest on a handful of "
        "sentences):", "",
        markdown_table(["language", "group", "train pairs", "test sentences", "deep BLEU", "wide BLEU",
                        "deep - wide"], languages, digits=3), "",
        "Reproduce: `make deep-vs-wide` (`python -m experiments.deep_vs_wide`); one model alone: "
        f"`gpipe-repro run transformer --layers {deep['L']} --ffn {deep['H']} --heads {deep['A']} "
        f"--d-model {deep['d_model']} --k {deep['partitions']} --m {deep['micro_batches']}`.",
    ])


def verdict_text(r: dict[str, Any]) -> str:
    gain = {g: r["bleu_gain_deep_over_wide"][g]["value"] for g in ("high", "low")}

    def describe(x: float) -> str:
        return "about equal" if abs(x) < 0.5 else (f"deep ahead by {x:.2f} BLEU" if x > 0
                                                     else f"wide ahead by {-x:.2f} BLEU")
    agrees = gain["low"] > 0 and gain["low"] > gain["high"]
    loss = {label: m["final_train_loss"]["value"] for label, m in r["models"].items()}
    return (f"high-resource: {describe(gain['high'])}; low-resource: {describe(gain['low'])}. "
            f"Final training loss (mean of the last 20 steps): deep {loss['deep']:.3f}, wide "
            f"{loss['wide']:.3f}; test NLL: deep {r['models']['deep']['nll']['value']:.3f}, wide "
            f"{r['models']['wide']['nll']['value']:.3f}. "
            + ("The direction matches the paper's claim (the deep model's advantage is larger on "
               "low-resource languages)." if agrees else
               "This does not reproduce the paper's claim at this scale.")
            + " One seed, a short budget and tiny low-resource test sets: differences of a BLEU point "
              "or two are within noise.")


def plot_losses(metrics: dict[str, Path], shapes: dict[str, str], path: Path) -> Path:
    """The two training-loss curves (smoothed) on one plot: is one model still catching up?"""
    from gpipe_repro.report.plots import pyplot, save_figure
    from gpipe_repro.report.wandb_log import read_metrics
    from gpipe_repro.train.curves import series, smoothed

    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for label, file in metrics.items():
        steps, loss = series(read_metrics(file), "train/loss")
        ax.plot(steps, loss, alpha=0.25, lw=0.8)
        ax.plot(steps, smoothed(loss, 0.95), color=ax.lines[-1].get_color(), lw=2,
                label=f"{label} {shapes[label]} (smoothed)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (label-smoothed, per token)")
    ax.set_title("deep vs wide: the same batches, the same schedule")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def plot_gains(r: dict[str, Any], path: Path) -> Path:
    """Per language: BLEU gain of the deep model over the wide one against its training pairs."""
    from gpipe_repro.report.plots import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(8, 4.8))
    colors = {"high": "tab:blue", "low": "tab:orange"}
    for lang, x in r["languages"].items():
        ax.scatter(x["train_pairs"], x["bleu_gain_deep_over_wide"]["value"], color=colors[x["group"]],
                   s=20 + 2 * x["test_sentences_scored"] ** 0.9, alpha=0.8, edgecolor="k", linewidth=0.5)
        ax.annotate(lang, (x["train_pairs"], x["bleu_gain_deep_over_wide"]["value"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    for g, color in colors.items():
        sizes = [x["train_pairs"] for x in r["languages"].values() if x["group"] == g]
        if sizes:
            gain = r["bleu_gain_deep_over_wide"][g]["value"]
            ax.hlines(gain, min(sizes), max(sizes), color=color, linestyle="--",
                      label=f"{g}-resource, pooled: {gain:+.2f}")
    ax.axhline(0.0, color="gray", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("training pairs of the language (log scale)")
    ax.set_ylabel("BLEU gain: deep - wide")
    deep, wide = r["models"]["deep"], r["models"]["wide"]
    ax.set_title(f"deep {deep['shape']} vs wide {wide['shape']}, d_model {deep['d_model']}, "
                 f"{r['budget']['steps']} steps (point size: test sentences)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


# ----------------------------------------------------------------------------- large batches
