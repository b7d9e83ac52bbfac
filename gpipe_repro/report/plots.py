"""Figures of the throughput results: speedup against K per M with the paper's points, and the
bubble fraction against M beside the paper's (K-1)/(M+K-1).

They read the same row dictionaries the results JSON holds (``Row.to_json()``), so a figure can be
redrawn from a results file without rerunning anything. matplotlib runs headless (Agg).

The figure plumbing every results figure shares (headless pyplot, a log-2 axis ticked at its values,
saving and closing) is here too: :func:`pyplot`, :func:`log2_axis`, :func:`save_figure`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_MARKERS = {1: "o", 2: "v", 4: "s", 8: "D", 16: "P", 32: "^", 64: "X"}


def pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend (imported on first use: matplotlib is slow to
    import and most commands draw nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log2_axis(ax: Any, values: Sequence[int], axis: str = "x") -> None:
    """A log-2 `axis` with one tick at each of `values`, labelled by the value (K or M: 1, 2, 4...)."""
    if axis == "x":
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(values), [str(v) for v in values])
    elif axis == "y":
        ax.set_yscale("log", base=2)
        ax.set_yticks(list(values), [str(v) for v in values])
    else:
        raise ValueError(f"axis must be 'x' or 'y', got {axis!r}")


def save_figure(fig: Any, path: str | Path, *, dpi: int = 120) -> Path:
    """Save `fig` as `path` (creating its folder), close it (pyplot keeps every open figure alive)
    and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def plot_speedups(tables: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path,
                  title: str = "Normalized training throughput (K=2, M=1 = 1)") -> Path:
    """One panel per model: our simulated speedup against K for each M (solid), our measured points
    (filled, large; hollow, red-edged and labelled "busy" where the host was not idle or its state
    was not recorded), the paper's (dashed, hollow) and torchgpipe's (dotted) where known."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4.2), squeeze=False)
    for ax, (model, rows) in zip(axes[0], tables.items()):
        ms = sorted({r["M"] for r in rows})
        for i, m in enumerate(ms):
            color = f"C{i}"
            sel = sorted((r for r in rows if r["M"] == m), key=lambda r: r["K"])
            ks = [r["K"] for r in sel]
            marker = _MARKERS.get(m, "o")
            ax.plot(ks, [r["simulated"]["normalized"] for r in sel], "-", marker=marker, color=color,
                    label=f"M={m} simulated")
            meas = [(r["K"], r["measured"]["normalized"], r["measured"].get(
                        "normalized_clean", "normalized_figure" in r["measured"]))
                    for r in sel if r.get("measured") and "normalized" in r["measured"]]
            clean = [(k, v) for k, v, ok in meas if ok]
            busy = [(k, v) for k, v, ok in meas if not ok]
            if clean:
                ax.plot(*zip(*clean), linestyle="none", marker=marker, markersize=10, color=color,
                        markeredgecolor="black", label=f"M={m} measured")
            if busy:   # visibly not clean: hollow, red-edged, labelled
                ax.plot(*zip(*busy), linestyle="none", marker=marker, markersize=11, mfc="none",
                        markeredgecolor="red", markeredgewidth=1.8,
                        label=f"M={m} measured, BUSY host (not clean)")
                for k, v in busy:
                    ax.annotate("busy", (k, v), textcoords="offset points", xytext=(6, -10),
                                fontsize=7, color="red")
            pap = [(r["K"], r["paper"]) for r in sel if r.get("paper") is not None]
            if pap:
                ax.plot(*zip(*pap), "--", marker=marker, mfc="none", color=color, alpha=0.8,
                        label=f"M={m} paper")
            peer = [(r["K"], r["torchgpipe"]) for r in sel if r.get("torchgpipe") is not None]
            if peer:
                ax.plot(*zip(*peer), ":", marker="x", color=color, alpha=0.7,
                        label=f"M={m} torchgpipe")
        ks_all = sorted({r["K"] for r in rows})
        ax.plot(ks_all, [k / min(ks_all) for k in ks_all], color="grey", lw=0.8, alpha=0.5,
                label="linear in K")
        log2_axis(ax, ks_all)
        ax.set_xlabel("partitions K")
        ax.set_ylabel("normalized throughput")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_bubble(curves: Sequence[Mapping[str, Any]], path: str | Path,
                title: str = "Bubble fraction against micro-batches") -> Path:
    """Simulated bubble (share of stage-time idle on every stage) against M, per K, with the paper's
    (K-1)/(M+K-1) as dashed lines."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for i, c in enumerate(curves):
        color = f"C{i}"
        ax.plot(c["ms"], c["simulated"], "-o", color=color, label=f"K={c['K']} simulated")
        ax.plot(c["ms"], c["theory"], "--", color=color, alpha=0.7, label=f"K={c['K']} (K-1)/(M+K-1)")
    log2_axis(ax, curves[0]["ms"] if curves else [])
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("bubble fraction")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return save_figure(fig, path)


__all__ = ["log2_axis", "plot_bubble", "plot_speedups", "pyplot", "save_figure"]
