"""gpu-check's outputs: the results directory (never overwritten without asking), JSON, markdown,
plots and the one-screen summary, all rendered from the one payload :func:`run_gpu_check` returns.

The directory rule: a new or empty directory is used as is; a directory holding a previous gpu-check
output (its ``gpu_check.json`` says so) is overwritten only when the user says yes (``--overwrite``,
or the prompt), and then only gpu-check's own files are replaced or removed; any other non-empty
directory is refused, so nothing a user owns is ever deleted or overwritten.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpipe_repro.repro.gpu_check import _deps

EXPERIMENT = "gpu-check"
MANIFEST = "gpu_check.json"
OWN_FILES = (MANIFEST, "gpu_check.md", "overhead.png", "memory.png", "throughput.png")


class OutputRefused(ValueError):
    """The output directory cannot be used (the message says why and what to do)."""


def previous_output(out: Path) -> dict[str, Any] | None:
    """The manifest of a previous gpu-check output in `out`, or None."""
    try:
        data = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("experiment") == EXPERIMENT else None


# Other records of the same device that may share its results/gpu/<device>/ directory: gpu-check
# writes beside them and never touches them (the microbatch probe's `--write` writes there).
COMPANION_RECORDS = frozenset({"probe_gpu_microbatches.json"})


def check_out_dir(out: Path, *, overwrite: bool = False,
                  confirm: Callable[[str], bool] | None = None) -> None:
    """Refuse `out` unless it is new, empty, or a previous gpu-check output the user agrees to replace
    (see the module docstring). Call it before any work starts."""
    if out.exists() and not out.is_dir():
        raise OutputRefused(f"--out {out} is a file, not a directory: give a directory")
    if not out.exists() or all(p.name in COMPANION_RECORDS for p in out.iterdir()):
        return
    previous = previous_output(out)
    if previous is None:
        names = sorted(p.name for p in out.iterdir())[:5]
        raise OutputRefused(f"--out {out} is not empty ({', '.join(names)}, ...) and holds no gpu-check "
                            "output: choose a new or empty directory (nothing there was touched)")
    if overwrite:
        return
    when = previous.get("environment", {}).get("time_utc", "an earlier run")
    question = f"{out} holds a gpu-check output from {when}; replace it?"
    if confirm is None or not confirm(question):
        raise OutputRefused(f"--out {out} holds a previous gpu-check output; pass --overwrite to replace it "
                            "or choose another directory (nothing was touched)")


def _gib(x: float | None) -> float | None:
    return None if x is None else x / 2**30


def _sim(record: Any) -> str:
    """A simulated record as "1.23*" (the paper's value has its own column)."""
    value = _value(record)
    return "-" if value is None else f"{value:.3g}*"


def _value(record: Any) -> Any:
    return record["value"] if isinstance(record, dict) and "value" in record else record


# ----------------------------------------------------------------------------- markdown

def render_markdown(payload: dict[str, Any]) -> str:
    """The report as markdown: one section per part; every number says measured or simulated."""
    dev = payload["device"]
    lines = [f"# gpu-check on {dev['name']} ({dev['device']})", "",
             f"Driver {dev.get('driver') or '-'}, CUDA {dev.get('cuda') or '-'}, torch {dev['torch']}. "
             + ("Tiny sizes (smoke test): the numbers show the code runs, not what the paper measured."
              if payload["settings"]["tiny"] else f"The paper: {_deps.paper.CITATION}."),
             "Numbers marked * are simulated; all others are measured on this device.", ""]
    parts = payload["parts"]
    if "engine" in parts:
        e = parts["engine"]
        lines += ["## 1. Engine = plain PyTorch, per parameter (measured)", "",
                  f"{e['passed']}/{e['total']} cases equal (loss, every gradient, every updated parameter, "
                  f"BatchNorm statistics). Reference: {e['reference']}.", ""]
        rows = [[c["case"], c["checkpoint"], c["precision"], "yes" if c["ok"] else "NO",
                 c.get("max_abs_diff"), "; ".join(c.get("failures", []))[:80] or c.get("error", "")[:80]]
                for c in e["cases"]]
        headers = ["case", "checkpoint", "precision", "equal", "max abs diff", "why not"]
        lines += [_deps.markdown_table(headers, rows), ""]
        lines += [f"- skipped: {s}" for s in e["skipped"]] + [""]
    if "overhead" in parts:
        o = parts["overhead"]
        lines += ["## 2. Engine overhead, K=1 M=1 vs a plain step (measured)", "",
                  f"Target: ratio <= {o['target_ratio']} without re-materialization; re-materialization tax "
                  f"vs the paper's {o['paper_remat_tax'][0]:.0%}-{o['paper_remat_tax'][1]:.0%}. Reported, "
                  "not asserted; host load average recorded.", ""]
        rows = [[r["model"], _value(r["median_step_s"]["plain"]) * 1e3, _value(r["ratio_never"]),
                 _value(r["ratio_always"]), _value(r["remat_tax"]), r["load_average_before"][0]]
                for r in o["rows"]]
        lines += [_deps.markdown_table(["model", "plain ms", "ratio never", "ratio always", "remat tax",
                                        "load avg"], rows), ""]
    if "memory" in parts:
        m = parts["memory"]
        lines += ["## 3. Memory: one cell alone vs the planner", "",
                  f"Measured peak ({m['cells'][0]['meter'] if m['cells'] else '-'}) vs the planner's "
                  f"prediction* for that cell; target within {m['target']:.0%}.", ""]
        rows = [[c["row"], f"{c['stage']} of {c['K']}", c["M"], c["checkpoint"],
                 _gib(_value(c["measured_peak_bytes"])), _gib(_value(c["planned_peak_bytes"])),
                 c["rel_error"], "yes" if c["within_target"] else "NO"] for c in m["cells"]]
        lines += [_deps.markdown_table(["row", "cell", "M", "checkpoint", "measured GiB", "planned GiB*",
                                        "error", "within"], rows), ""]
        d = m["depth"]
        lines += [f"Deepest {d['model']} within {_gib(d['budget_bytes']):.3g} GiB "
                  f"({d['budget_source']}):", ""]
        rows = [[r["row"], r["M"], r["checkpoint"], _value(r["measured_L"]), _value(r["planned_L"]),
                 len(r["probes"]), r["stopped"] or ""] for r in d["rows"]]
        lines += [_deps.markdown_table(["row", "M", "checkpoint", "measured L", "planner L*", "steps run",
                                        "note"], rows), ""]
        lines += [f"- skipped: {s}" for s in m["skipped"]] + [""]
    if "costs" in parts:
        c = parts["costs"]
        lines += ["## 4. Tables 2 and 3 from costs measured on this device (simulated*)", ""]
        for table, models in c["tables"].items():
            for model, rows_ in models.items():
                cal = c["calibrations"][table][model]
                lines += [f"### {table.replace('table', 'Table ')}: {cal['workload']} "
                          f"(normalized to {c['normalized_to'][table]})", "",
                          f"Measured: one micro-batch of {cal['microbatch']} forward + backward "
                          f"{_value(cal['forward_backward_s']) * 1e3:.3g} ms on {cal['device']}.", ""]
                rows = [[r["K"], r["M"], *[_sim(r["links"][ln]["normalized"]) for ln in r["links"]],
                         _sim(r["flop_model"]), r["paper"], " ".join(map(str, r["balance"]))] for r in rows_]
                links = list(rows_[0]["links"]) if rows_ else []
                lines += [_deps.markdown_table(["K", "M", *[f"{ln}*" for ln in links], "FLOP model*",
                                                "paper", "balance"], rows), ""]
        lines += ["Link models: " + "; ".join(f"{k}: {v['source']}" for k, v in c["links"].items()), ""]
        lines += [f"- skipped: {s}" for s in c["skipped"]] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots

def draw_plots(payload: dict[str, Any], out: Path) -> list[Path]:
    """overhead.png, memory.png, throughput.png (those whose part ran)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []
    parts = payload["parts"]
    if parts.get("overhead", {}).get("rows"):
        rows = parts["overhead"]["rows"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(rows))
        for shift, mode in ((-0.2, "never"), (0.2, "always")):
            ax.bar([x + shift for x in xs], [float(_value(r[f"ratio_{mode}"])) for r in rows], 0.4,
                   label=f"checkpoint={mode}")
        ax.axhline(parts["overhead"]["target_ratio"], color="k", ls="--", lw=1, label="target 1.03")
        ax.axhspan(1.25, 1.33, color="grey", alpha=0.2, label="paper remat 1.25-1.33")
        ax.set_xticks(list(xs), [r["model"][:28] for r in rows], fontsize=7)
        ax.set_ylabel("step time / plain step (measured)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(_save(fig, out / "overhead.png", plt))
    if parts.get("memory", {}).get("cells"):
        cells = parts["memory"]["cells"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(cells))
        for shift, key, label in ((-0.2, "measured_peak_bytes", "measured"),
                                  (0.2, "planned_peak_bytes", "planner (simulated)")):
            ax.bar([x + shift for x in xs], [float(_value(c[key]) or 0) / 2**30 for c in cells], 0.4,
                   label=label)
        ax.set_xticks(list(xs), [c["row"] for c in cells], fontsize=7, rotation=15)
        ax.set_ylabel("peak of the largest cell, GiB")
        ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(_save(fig, out / "memory.png", plt))
    tables = parts.get("costs", {}).get("tables", {})
    panels = [(t, m, rows) for t, ms in tables.items() for m, rows in ms.items() if rows]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
        for ax, (table, model, rows) in zip(axes[0], panels):
            for m in sorted({r["M"] for r in rows}):
                sel = [r for r in rows if r["M"] == m]
                ks = [r["K"] for r in sel]
                for ln, style in (("nvlink", "-"), ("pcie", ":")):
                    ax.plot(ks, [_value(r["links"][ln]["normalized"]) for r in sel], style, marker="o",
                            label=f"M={m} {ln}*")
                ax.plot(ks, [_value(r["flop_model"]) for r in sel], "--", alpha=0.6, label=f"M={m} FLOP*")
                paper = [(r["K"], r["paper"]) for r in sel if r["paper"] is not None]
                if paper:
                    ax.plot(*zip(*paper), "x", ms=8, label=f"M={m} paper")
            ax.set_title(f"{table} {model}", fontsize=9)
            ax.set_xlabel("K")
            ax.set_ylabel("normalized throughput")
            ax.legend(fontsize=5)
        fig.tight_layout()
        files.append(_save(fig, out / "throughput.png", plt))
    return files


def _save(fig: Any, path: Path, plt: Any) -> Path:
    with _deps.atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- writing

def write_report(payload: dict[str, Any], out: Path) -> list[Path]:
    """JSON (the manifest), markdown and plots into `out`; stale files of an earlier gpu-check
    output there are removed, nothing else is touched. Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    previous = previous_output(out)
    files = [_deps.write_markdown(out / "gpu_check.md", render_markdown(payload)), *draw_plots(payload, out)]
    names = [MANIFEST] + [p.name for p in files]
    _deps.write_json(out / MANIFEST, {**payload, "files": names})
    for stale in (previous or {}).get("files", []):
        if stale in OWN_FILES and stale not in names:
            (out / stale).unlink(missing_ok=True)
    return [out / MANIFEST, *files]


def summary(payload: dict[str, Any], files: list[Path] | None = None) -> str:
    """The one-screen summary printed at the end of a run."""
    dev = payload["device"]
    parts = payload["parts"]
    lines = [f"gpu-check on {dev['name']} ({dev['device']}), driver {dev.get('driver') or '-'}, "
             f"CUDA {dev.get('cuda') or '-'}, torch {dev['torch']}"
             + ("  [TINY sizes: a smoke test]" if payload["settings"]["tiny"] else "")]
    if "engine" in parts:
        e = parts["engine"]
        lines.append(f"1 engine == plain PyTorch: {e['passed']}/{e['total']} cases "
                     f"{'PASS' if e['ok'] else 'FAIL'}")
        lines += [f"    FAIL {c['case']} {c['checkpoint']} {c['precision']}: "
                  f"{c.get('error') or '; '.join(c.get('failures', []))}"[:160]
                  for c in e["cases"] if not c["ok"]][:4]
    if "overhead" in parts:
        for r in parts["overhead"]["rows"]:
            lines.append(f"2 {r['model'][:40]}: K=1 M=1 never {_value(r['ratio_never']):.3f}x "
                         f"(target <= 1.03: {'met' if r['within_target'] else 'MISSED'}), remat tax "
                         f"{_value(r['remat_tax']):.0%} (paper 25-33%), "
                         f"load {r['load_average_before'][0]:.1f}")
    if "memory" in parts:
        m = parts["memory"]
        for c in m["cells"]:
            err = "-" if c["rel_error"] is None else f"{c['rel_error']:+.1%}"
            lines.append(f"3 {c['row']} cell {c['stage']}/{c['K']}: measured "
                         f"{_gib(_value(c['measured_peak_bytes'])):.3g} GiB, planned "
                         f"{_gib(_value(c['planned_peak_bytes'])):.3g} GiB*, {err} "
                         f"({'within' if c['within_target'] else 'OUTSIDE'} {m['target']:.0%})")
        for r in m["depth"]["rows"]:
            lines.append(f"3 deepest Transformer-L, {r['row']}: measured L={_value(r['measured_L'])}, "
                         f"planner L={_value(r['planned_L'])}* ({len(r['probes'])} real steps)"
                         + (f" [{r['stopped']}]" if r["stopped"] else ""))
    if "costs" in parts:
        for table, models in parts["costs"]["tables"].items():
            for model, rows in models.items():
                top = max(rows, key=lambda r: (r["K"], r["M"]))
                lines.append(f"4 {table} {model} K={top['K']} M={top['M']}: nvlink "
                             f"{_value(top['links']['nvlink']['normalized']):.2f}*, pcie "
                             f"{_value(top['links']['pcie']['normalized']):.2f}*, FLOP model "
                             f"{_value(top['flop_model']):.2f}*, paper {top['paper'] or '-'}")
    for name, part in parts.items():
        for s in part.get("skipped", [])[:2]:
            lines.append(f"  ({name} skipped: {s})"[:160])
    lines.append("* simulated; everything else measured on this device.")
    if files:
        lines.append(f"written: {files[0].parent}/ ({', '.join(p.name for p in files)})")
    return "\n".join(lines)


__all__ = ["check_out_dir", "write_report", "render_markdown", "summary", "draw_plots", "previous_output",
           "OutputRefused", "MANIFEST", "OWN_FILES", "EXPERIMENT"]
