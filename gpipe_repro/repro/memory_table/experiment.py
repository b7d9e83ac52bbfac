"""`make memory-table`: Table 1, the activation-memory curve and the planner's validation, as data.

:func:`run` computes everything into one JSON-able payload; :func:`write` renders it to
``results/memory/`` (JSON with the environment, markdown, PNGs) and logs it through
:class:`~gpipe_repro.report.wandb_log.RunLogger` (offline by default). The experiment script only declares
the :class:`Settings`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpipe_repro.memory.profile import ProfileCache
from gpipe_repro.paper import CITATION, TABLE1_AMOEBANET, TABLE1_TRANSFORMER
from gpipe_repro.repro.memory_table.table1 import (
    Table1Settings,
    amoebanet_paper_models,
    amoebanet_rows,
    naive_head_breakdown,
    paper_used_gib,
    transformer_rows,
)


@dataclass(frozen=True)
class Settings:
    table1: Table1Settings = field(default_factory=Table1Settings)
    scaling_L: int = 24                              # Transformer-L of the activation curve
    scaling_ks: tuple[int, ...] = (1, 2, 4, 8)
    scaling_ms: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    validation_ks: tuple[int, ...] = (1, 2, 4)
    validation_checkpoints: tuple[str, ...] = ("except_last", "never")
    validation_micro_batches: int = 4
    amoebanet: bool = True


def _timed(log: Callable[[str], None], what: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    log(f"{what}: {time.perf_counter() - t0:.1f} s")
    return out


def run(settings: Settings, log: Callable[[str], None] = print) -> dict[str, Any]:
    from gpipe_repro.memory.scaling import activation_grid, fit_paper_model, is_monotone
    from gpipe_repro.memory.search import transformer_planner
    from gpipe_repro.memory.validation import small_workloads, validate_cpu, validate_cuda

    t0, c0 = time.perf_counter(), time.process_time()
    cache = ProfileCache()
    t1 = settings.table1
    payload: dict[str, Any] = {"experiment": "memory_table", "citation": CITATION,
                               "settings": asdict(settings)}
    tf: dict[str, Any] = {"device_memory_gib": TABLE1_TRANSFORMER["device_memory_gb"],
                          "batch": TABLE1_TRANSFORMER["batch"], "seq_len": TABLE1_TRANSFORMER["seq_len"]}
    tf["rows"] = _timed(log, "Transformer rows (fused attention)",
                        lambda: transformer_rows(t1, cache, "fused"))
    variants = {"fused attention, 16 GiB": tf["rows"]}
    if "math" in t1.attention_variants:
        variants["math attention (materialized), 16 GiB"] = _timed(
            log, "Transformer rows (math attention)", lambda: transformer_rows(t1, cache, "math"))
    variants["fused attention, the paper's used memory per device"] = _timed(
        log, "Transformer rows (paper's used memory)",
        lambda: transformer_rows(t1, cache, "fused", budget_gib=paper_used_gib))
    tf["variants"] = variants
    tf["naive"] = naive_head_breakdown(cache)
    payload["transformer"] = tf
    if settings.amoebanet:
        payload["amoebanet"] = {"device_memory_gib": TABLE1_AMOEBANET["device_memory_gb"],
                                "batch": TABLE1_AMOEBANET["batch"],
                                "image_size": TABLE1_AMOEBANET["image_size"],
                                "rows": _timed(log, "AmoebaNet rows", lambda: amoebanet_rows(t1, cache))}
        payload["amoebanet"]["paper_models"] = _timed(
            log, "AmoebaNet: the paper's models under our accounting",
            lambda: amoebanet_paper_models(t1, cache))

    def curve() -> dict[str, Any]:
        planner = transformer_planner(settings.scaling_L, cache)
        grid = activation_grid(planner, settings.scaling_ks, settings.scaling_ms)
        return {"model": f"Transformer-{settings.scaling_L}", "batch": planner.batch, "grid": grid,
                "fit": fit_paper_model(grid), "monotone": is_monotone(grid), "method": "simulated"}
    payload["scaling"] = _timed(log, "activation vs M and K", curve)

    def validation() -> dict[str, Any]:
        cpu = validate_cpu(small_workloads(), settings.validation_ks, settings.validation_checkpoints,
                           settings.validation_micro_batches)
        out: dict[str, Any] = {"cpu": cpu, "method": "measured (CPU, tracker on real tensors) vs "
                                                     "simulated (planner; engine on fake tensors)",
                               "max_rel_error": max(r["max_rel_error"] for r in cpu)}
        if torch.cuda.is_available():
            out["cuda"] = [validate_cuda(w) for w in small_workloads()]
        else:
            out["cuda"] = "not run: no CUDA device in this session (code path: validation.validate_cuda)"
        return out
    payload["validation"] = _timed(log, "validation against real runs", validation)
    payload["profiles_traced"] = cache.misses
    payload["seconds"] = time.perf_counter() - t0
    payload["cpu_seconds"] = time.process_time() - c0     # the machine may be shared
    return payload


def _notes(p: dict[str, Any]) -> list[str]:
    """The findings, written from the numbers."""
    tf = p["transformer"]
    rows = {r["name"]: r for r in tf["rows"]}
    used = {r["name"]: r for r in tf["variants"]["fused attention, the paper's used memory per device"]}
    naive = tf["naive"]
    head = naive["per_layer"]
    notes = []
    pipe_names = [n for n in rows if n != "Naive-1"]
    ratios = [rows[n]["L"]["value"] / rows[n]["L"]["paper"] for n in pipe_names
              if rows[n]["L"]["value"] and rows[n]["L"].get("paper")]
    notes.append(
        "Transformer, pipeline rows: ours / paper layer count = "
        + ", ".join(f"{n} {r:.2f}" for n, r in zip(pipe_names, ratios)) + ". "
        "Pipeline-1 matches exactly (13 layers; peak activation "
        f"{rows['Pipeline-1']['peak_activation_gib']['value']:.2f} GiB vs the paper's 6.4). The paper's "
        "Pipeline-K rows report using only (param + peak activation) / K = "
        + ", ".join(f"{paper_used_gib(n):.2f}" for n in pipe_names if n != "Pipeline-1")
        + " GiB per device of the 16; with that budget the planner gives "
        + ", ".join(f"L={used[n]['L']['value']}" for n in pipe_names if n != "Pipeline-1")
        + " (paper " + ", ".join(str(used[n]['L']['paper']) for n in pipe_names if n != "Pipeline-1")
        + "): the difference is the memory the paper left unused (or XLA kept for itself), not the "
        "accounting of parameters and activations.")
    loss = head.get("LossLayer", {})
    notes.append(
        "Transformer, Naive-1: in eager PyTorch fp32 no layer fits 16 GiB without re-materialization "
        f"(Transformer-0, the embedding and softmax alone, peaks at "
        f"{naive['naive_peak_gib']['L=0']['value']:.1f} GiB, Transformer-1 at "
        f"{naive['naive_peak_gib']['L=1']['value']:.1f} GiB). The 32 x 1024 x 32k logits are 3.9 GiB; "
        "the loss keeps its log-softmax (3.9 GiB) and its backward holds two more of that size "
        f"(loss backward peak {loss.get('backward_peak_gib', {}).get('value', float('nan')):.1f} GiB); "
        "XLA fuses the softmax cross-entropy. The paper's Naive-1 fits 3 layers.")
    notes.append(
        "Attention: PyTorch's fused kernel keeps O(N T d) per layer; the math backend (what XLA "
        "did in 2018) keeps the N x 32 x 1024 x 1024 attention matrix. The paper's layer counts "
        "lie between the two settings.")
    if "amoebanet" in p:
        a = {r["name"]: r for r in p["amoebanet"]["rows"]}
        notes.append(
            "AmoebaNet: at the paper's depth per row the widest D is "
            + ", ".join(f"{n} D={a[n]['D']['value']} (paper {a[n]['D']['paper']})" for n in a) + ".")
        pm = {r["name"]: r for r in p["amoebanet"].get("paper_models", [])}
        if "Naive-1" in pm:
            n1 = pm["Naive-1"]
            notes.append(
                f"AmoebaNet, Naive-1: the paper's ({n1['L']}, {n1['D']}) at batch 128 without "
                f"re-materialization keeps {n1['peak_activation_gib']['value']:.1f} GiB of activations "
                f"in eager PyTorch fp32 (paper: {n1['peak_activation_gib']['paper']} GB), i.e. "
                f"{1024 * n1['peak_activation_gib']['value'] / 128:.0f} MiB per 224x224 image: every ReLU "
                "output, BatchNorm input, max-pool index (int64) and concatenation is a separate tensor "
                "kept for the backward, where the paper's TensorFlow fused them. So Naive-1 is far "
                "narrower here, and the pipeline/Naive ratios far larger. With re-materialization "
                "only one micro-batch's working set is alive at a time, and the pipeline rows reach "
                + ", ".join(f"{n} {a[n]['params']['value'] / a[n]['params']['paper']:.2f}"
                            for n in a if n != "Naive-1" and a[n]["params"]["value"])
                + " of the paper's parameter counts.")
    return notes
    return notes


def _cuda_line(cuda: Any) -> str:
    if isinstance(cuda, str):
        return cuda
    worst = max(r["rel_error"] for r in cuda)
    return f"planner vs torch.cuda.max_memory_allocated, largest error {100 * worst:.1f}% (target 10%)"


COMMAND = "memory-table"
MANIFEST = "memory_table.json"
OWN_FILES = (MANIFEST, "memory_table.md", "max_params.png", "activation_vs_microbatches.png")


def is_memory_table(data: Any) -> bool:
    """A memory_table.json written before outputs were stamped."""
    return {"transformer", "scaling", "validation", "settings"} <= set(data)


def check_out_dir(out: Path, *, overwrite: bool, record: bool = False) -> None:
    """Refuse, before any work, to replace a file in `out` that this command did not write (its
    memory_table.json says which are its own), or its own without --overwrite, or the results of
    record without --record (what `make memory-table` gives); see
    :func:`gpipe_repro.report.output_guard.check_outputs`."""
    from gpipe_repro.report.output_guard import OutputRefused, check_outputs, owned_json
    if out.exists() and not out.is_dir():
        raise OutputRefused(f"--out {out} is a file, not a directory: give a directory")
    check_outputs([out / name for name in OWN_FILES], command=COMMAND, option="--out",
                  overwrite=overwrite, own=lambda _: owned_json(out / MANIFEST, COMMAND, is_memory_table),
                  make_target=COMMAND, record=record)


def write(payload: dict[str, Any], out: Path, wandb: bool = True) -> dict[str, Path]:
    from gpipe_repro.report.records import read_json, results_root, write_json, write_markdown
    from gpipe_repro.repro.memory_table.report import (
        grid_markdown,
        paper_models_markdown,
        plot_activation_grid,
        plot_max_params,
        table1_markdown,
        validation_markdown,
        variants_markdown,
    )

    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json(out / MANIFEST, {**payload, "written_by": COMMAND})}
    payload = read_json(paths["json"])
    models = {"Transformer-L (16 GiB per device)": payload["transformer"]["rows"]}
    if "amoebanet" in payload:
        models["AmoebaNet-D (L, D) (8 GiB per device)"] = payload["amoebanet"]["rows"]
    paths["max_params"] = plot_max_params(models, out / "max_params.png")
    sc = payload["scaling"]
    paths["activation"] = plot_activation_grid(
        sc["grid"], sc["fit"], out / "activation_vs_microbatches.png",
        f"{sc['model']}, batch {sc['batch']}: peak activation per device")
    s = payload["settings"]["table1"]
    md = [f"# Table 1: maximum model size ({payload['citation']})", "",
          "Ours are simulated by the memory planner (`*`): each distinct layer profiled once on fake "
          "tensors, composed along the engine's schedule; the paper's value in parentheses. Budgets "
          "in GiB per device. Pipeline rows use "
          f"M = {s['micro_batches']} micro-batches and re-materialize every micro-batch but the last; "
          "Naive-1 is K = 1, M = 1 without re-materialization. RMSProp (12 bytes per parameter). "
          "Partitions minimize the largest device's memory.", "",
          "## Transformer-L (d 2048, ff 8192, 32 heads, 32k vocabulary, batch 32 x 1024 tokens, 16 GiB)",
          "", table1_markdown(payload["transformer"]["rows"], ["L"]), "",
          "Largest L under other settings (same search):", "",
          variants_markdown(payload["transformer"]["variants"]), ""]
    if "amoebanet" in payload:
        md += ["## AmoebaNet-D (L, D), 224 x 224, batch 128, 8 GiB", "",
               "D is the widest multiple of 16 that fits at the paper's depth L for the row.", "",
               table1_markdown(payload["amoebanet"]["rows"], ["L", "D"]), "",
               "The paper's own models under our accounting (same M):", "",
               paper_models_markdown(payload["amoebanet"].get("paper_models", [])), ""]
    md += ["## Findings", ""] + [f"- {n}" for n in _notes(payload)] + [""]
    md += [f"## Peak activation per device vs M and K ({sc['model']}, batch {sc['batch']})", "",
           grid_markdown(sc["grid"]), "",
           f"Fit of the paper's O(N + (L/K)(N/M)) as a + b/(K M): a = {sc['fit']['a_gib']:.3f} GiB, "
           f"b = {sc['fit']['b_gib']:.3f} GiB, R^2 = {sc['fit']['r2']:.4f}. Falls with M at every K: "
           f"{sc['monotone']['falls_with_M']}; falls with K at every M: {sc['monotone']['falls_with_K']}.",
           "", "![activation](activation_vs_microbatches.png)", "",
           "## Validation: planner vs a real step on this CPU", "",
           validation_markdown(payload["validation"]["cpu"]), "",
           f"Largest error: {100 * payload['validation']['max_rel_error']:.2f}% (target: 5%). "
           f"CUDA: {_cuda_line(payload['validation']['cuda'])}.",
           "", "![max params](max_params.png)", "",
           f"{payload['profiles_traced']} layer profiles traced; {payload['seconds']:.0f} s in all "
           f"({payload.get('cpu_seconds', float('nan')):.0f} s of CPU time)."]
    paths["md"] = write_markdown(out / "memory_table.md", "\n".join(md))
    if wandb:
        from gpipe_repro.report.wandb_log import RunLogger
        with RunLogger("gpipe-repro", config=payload["settings"],
                       dir=results_root() / "runs" / "memory-table",
                       name="memory-table", tags=["table1"]) as run:
            for name, rows in models.items():
                run.log_table(name.split(" ")[0], ["row", "size", "params"],
                              [[r["name"], str([r[k]["value"] for k in ("L", "D") if k in r]),
                                r["params"]["value"]] for r in rows])
            run.log_image("max_params", paths["max_params"])
            run.log_image("activation_vs_microbatches", paths["activation"])
            run.summary({"validation_max_rel_error": payload["validation"]["max_rel_error"],
                         "seconds": payload["seconds"]})
    return paths


__all__ = ["Settings", "check_out_dir", "run", "write"]
