"""Markdown and figures of the memory results, rendered from the results JSON alone.

Tables put ours beside the paper's as ``value* (paper x)`` (``*``: simulated by the planner;
measured numbers carry no star). Figures: maximum parameters against devices with the paper's
points, and peak activation per device against M for each K with the fitted a + b/(K M).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from gpipe_repro.report.plots import pyplot, save_figure
from gpipe_repro.report.records import format_record, markdown_table


def _labels_then_numbers(n: int) -> list[Literal["left", "right", "center"]]:
    """Column alignment: a left-aligned label column, then `n` right-aligned value columns."""
    right: Literal["right"] = "right"
    return ["left", *[right] * n]


def _rec(value: Any, digits: int = 3) -> str:
    if isinstance(value, Mapping) and "value" in value:
        return format_record(value, digits)
    return "-" if value is None else str(value)


def _params(rec: Mapping[str, Any]) -> str:
    def human(x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x / 1e9:.2f}B" if x >= 1e9 else f"{x / 1e6:.1f}M"
    star = "*" if rec.get("method") == "simulated" and rec.get("value") is not None else ""
    paper = f" (paper {human(rec['paper'])})" if rec.get("paper") else ""
    return human(rec.get("value")) + star + paper


def table1_markdown(rows: Sequence[Mapping[str, Any]], size_keys: Sequence[str]) -> str:
    """The paper's layout: one column per configuration, one line per quantity."""
    headers = [""] + [r["name"] for r in rows]
    lines: list[list[Any]] = []
    for key in size_keys:
        lines.append([key] + [_rec(r[key]) for r in rows])
    lines.append(["params"] + [_params(r["params"]) for r in rows])
    lines.append(["param memory (GiB)"] + [_rec(r["param_memory_gib"]) for r in rows])
    lines.append(["peak activation memory (GiB, all devices)"] +
                 [_rec(r["peak_activation_gib"]) for r in rows])
    lines.append(["largest device peak (GiB)"] + [_rec(r["max_device_peak_gib"]) for r in rows])
    lines.append(["micro-batches M"] + [str(r["micro_batches"]) for r in rows])
    lines.append(["params / Naive-1"] + [_rec(r.get("ratio_to_naive")) for r in rows])
    return markdown_table(headers, lines, align=_labels_then_numbers(len(rows)))


def variants_markdown(variants: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """Largest L per row under each setting, with the paper's beside."""
    names = [r["name"] for r in next(iter(variants.values()))]
    lines = [[label] + [_rec({**r["L"], "paper": None}) for r in rows] for label, rows in variants.items()]
    first = next(iter(variants.values()))
    lines.append(["paper"] + [str(r["L"].get("paper", "-")) for r in first])
    return markdown_table(["setting"] + names, lines, align=_labels_then_numbers(len(names)))


def paper_models_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [[r["name"], f"({r['L']}, {r['D']})", r["micro_batches"], _params(r["params"]),
              _rec(r["max_device_peak_gib"]), _rec(r["peak_activation_gib"])] for r in rows]
    return markdown_table(["row", "(L, D)", "M", "params", "largest device peak GiB (budget)",
                           "peak activation GiB (paper)"], lines)


def grid_markdown(grid: Sequence[Mapping[str, Any]], key: str = "max_device_activation_gib") -> str:
    ks = sorted({g["K"] for g in grid})
    ms = sorted({g["M"] for g in grid})
    table = {(g["K"], g["M"]): g[key] for g in grid}
    rows = [[f"K={k}"] + [table.get((k, m)) for m in ms] for k in ks]
    return markdown_table(["GiB per device"] + [f"M={m}" for m in ms], rows, digits=3)


def validation_markdown(results: Sequence[Mapping[str, Any]]) -> str:
    gib = 2 ** 20

    def mib(xs: Sequence[int] | None) -> str:
        return "-" if xs is None else ", ".join(f"{x / gib:.2f}" for x in xs)
    rows = [[r["model"], r["partitions"], r["micro_batches"], r["checkpoint"], mib(r["measured_bytes"]),
             mib(r["planned_bytes"]), mib(r.get("traced_bytes")), f"{100 * r['max_rel_error']:.2f}%"]
            for r in results]
    return markdown_table(["model", "K", "M", "checkpoint", "measured (MiB per device)",
                           "planned* (MiB)", "engine on fake tensors* (MiB)", "max error"], rows)


def _log_log(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    """The memory figures' axes: log-2 x (devices or micro-batches), log y, labels, grid, legend."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def plot_max_params(models: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path) -> Path:
    """Per model: the largest parameter count against devices, ours (simulated) and the paper's;
    Naive-1 drawn apart at one device."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, (title, rows) in zip(axes[0], models.items()):
        pipe = [r for r in rows if r["name"] != "Naive-1"]
        naive = [r for r in rows if r["name"] == "Naive-1"]
        ks = [r["partitions"] for r in pipe]
        ours = [r["params"]["value"] or float("nan") for r in pipe]
        paper = [r["params"].get("paper") or float("nan") for r in pipe]
        ax.plot(ks, ours, "o-", label="ours, pipeline (planner)")
        ax.plot(ks, paper, "s--", mfc="none", label="paper, pipeline")
        for r in naive:
            if r["params"]["value"]:
                ax.plot([1], [r["params"]["value"]], "x", ms=10, color="C0", label="ours, Naive-1")
            if r["params"].get("paper"):
                ax.plot([1], [r["params"]["paper"]], "+", ms=12, color="C1", label="paper, Naive-1")
        _log_log(ax, "devices K", "largest model (parameters)", title)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_activation_grid(grid: Sequence[Mapping[str, Any]], fit: Mapping[str, float],
                         path: str | Path, title: str) -> Path:
    """Peak activation per device against M, one line per K, with the fitted a + b/(K M)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for i, k in enumerate(sorted({g["K"] for g in grid})):
        pts = sorted((g["M"], g["max_device_activation_gib"]) for g in grid if g["K"] == k)
        ms = [m for m, _ in pts]
        ax.plot(ms, [v for _, v in pts], "o-", color=f"C{i}", label=f"K={k} (planner)")
        ax.plot(ms, [fit["a_gib"] + fit["b_gib"] / (k * m) for m in ms], ":", color=f"C{i}")
    ax.plot([], [], "k:", label=f"a + b/(K M) fit, R^2={fit['r2']:.3f}")
    _log_log(ax, "micro-batches M", "peak activation per device (GiB)", title)
    fig.tight_layout()
    return save_figure(fig, path)


__all__ = ["table1_markdown", "paper_models_markdown", "variants_markdown", "grid_markdown",
           "validation_markdown", "plot_max_params", "plot_activation_grid"]
