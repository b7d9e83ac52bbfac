"""Pictures of a training run, drawn from its metrics.jsonl rows (so they can be redrawn later
without rerunning anything): the run's curves, and loss curves of several runs on one plot (K=1 vs
K=4 must lie on top of each other). matplotlib runs headless (Agg)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpipe_repro.report.plots import pyplot as _pyplot


def series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of every row that has `key`."""
    pairs = [(int(r["step"]), float(r[key])) for r in rows if key in r and r.get("step") is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def smoothed(values: Sequence[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (what W&B's smoothing slider shows)."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def is_score(key: str) -> bool:
    """Metrics on a 0-100 scale (accuracy in %, BLEU), drawn on their own axis apart from losses."""
    return any(part.startswith(("top", "bleu", "acc")) for part in key.lower().split("/")[1:])


def plot_run_curves(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str) -> Path:
    """Four panels: training loss (raw and smoothed), evaluation metrics, learning rate, samples/s."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    steps, loss = series(rows, "train/loss")
    ax = axes[0][0]
    ax.plot(steps, loss, color="C0", alpha=0.3, lw=0.8, label="per step")
    ax.plot(steps, smoothed(loss), color="C0", label="smoothed")
    ax.set_title("training loss")
    ax.legend()
    ax = axes[0][1]
    eval_keys = sorted({k for r in rows for k in r if k.startswith("eval/") and not k.endswith("_s")})
    scores = [k for k in eval_keys if is_score(k)]            # accuracy %, BLEU: 0-100
    others = [k for k in eval_keys if not is_score(k)]        # losses, NLL: another unit, another axis
    for i, key in enumerate(scores):
        ax.plot(*series(rows, key), marker="o", color=f"C{i + 1}", label=key)
    if scores:
        ax.set_ylabel("score (0-100)")
        ax.legend(loc="upper left")
    if others:
        right = ax.twinx() if scores else ax
        for i, key in enumerate(others, start=len(scores) + 1):
            right.plot(*series(rows, key), marker="s", ls="--", color=f"C{i}", label=key)
        right.set_ylabel(" / ".join(k.removeprefix("eval/") for k in others))
        right.legend(loc="upper right" if scores else "best")
    ax.set_title("evaluation")
    ax = axes[1][0]
    ax.plot(*series(rows, "train/lr"), color="C3")
    ax.set_title("learning rate")
    ax = axes[1][1]
    s, v = series(rows, "train/samples_per_s")
    ax.plot(s, v, color="C4", alpha=0.4, lw=0.8)
    ax.plot(s, smoothed(v), color="C4")
    ax.set_title("throughput (samples/s)")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss_comparison(curves: Mapping[str, tuple[Sequence[int], Sequence[float]]], path: str | Path,
                         title: str) -> Path:
    """Loss curves of several runs on one plot, plus their difference to the first one."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    styles = ["-", "--", ":", "-."]
    reference_label, (ref_steps, ref_loss) = next(iter(curves.items()))
    for i, (label, (steps, loss)) in enumerate(curves.items()):
        top.plot(steps, loss, styles[i % len(styles)], color=f"C{i}", lw=2.2 - 0.5 * i, label=label)
        if i:
            diff = [abs(a - b) for a, b in zip(loss, ref_loss)]
            if max(diff) == 0.0:   # a log axis cannot show 0: say it
                bottom.text(0.5, 0.5 - 0.2 * (i - 1), f"{label} - {reference_label}: 0 at every step "
                            "(bitwise identical)", transform=bottom.transAxes, ha="center",
                            color=f"C{i}")
                continue
            bottom.plot(steps[:len(diff)], [max(d, 1e-12) for d in diff], color=f"C{i}",
                        label=f"|{label} - {reference_label}|")
    top.set_ylabel("training loss")
    top.set_title(title)
    top.legend()
    top.grid(alpha=0.3)
    if bottom.lines:
        bottom.set_yscale("log")
        bottom.legend()
    bottom.set_ylabel("abs. difference")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
