"""Writing a throughput table: JSON, markdown, figures, W&B; and the rich progress bar."""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpipe_repro.engine.timeline import Timeline
from gpipe_repro.report import gantt
from gpipe_repro.report.host import BUSY_MARK
from gpipe_repro.report.output_guard import check_outputs, owned_json
from gpipe_repro.report.plots import plot_bubble, plot_speedups
from gpipe_repro.report.records import read_json, results_root, write_json, write_markdown
from gpipe_repro.report.wandb_log import RunLogger
from gpipe_repro.repro.throughput.measure import distributed_measure
from gpipe_repro.repro.throughput.report import measured_host, measured_note, render_markdown
from gpipe_repro.repro.throughput.settings import SweepSettings
from gpipe_repro.repro.throughput.table import plan_steps, run_throughput_table


def display_path(path: str | os.PathLike[str]) -> str:
    """`path` relative to the working directory where it lies under it (a page of record names
    results/throughput/throughput_table.json, not the checkout's absolute place), else as given."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def has_measured(payload: dict[str, Any]) -> bool:
    """Whether a throughput payload holds any measured cell."""
    return any(r.get("measured") for table in ("table2", "table3")
               for rows in (payload.get(table) or {}).values() for r in rows)


COMMAND = "throughput-table"
MANIFEST = "throughput_table.json"
OWN_FILES = (MANIFEST, "throughput_table.md", "speedup.png", "bubble.png", "gantt.png",
             "gantt_measured.png")


def is_table(data: Any) -> bool:
    """A throughput_table.json written before outputs were stamped."""
    return {"table2", "table3", "settings"} <= set(data)


def owns(out_dir: str | os.PathLike[str]) -> bool:
    """Whether `out_dir` holds a throughput table this command wrote (its JSON says so)."""
    return owned_json(Path(out_dir) / MANIFEST, COMMAND, is_table)


def check_out_dir(out_dir: str | os.PathLike[str], *, overwrite: bool, record: bool = False) -> None:
    """Refuse, before any work, an --out whose files this command would replace without being its
    own previous table, or (its own) without --overwrite; in the results of record, without
    --record (what `make throughput-table` gives). See
    :func:`gpipe_repro.report.output_guard.check_outputs`."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a directory: give a directory")
    check_outputs([out / name for name in OWN_FILES], command=COMMAND, option="--out",
                  overwrite=overwrite, own=lambda _: owns(out), make_target=COMMAND, record=record)


def check_overwrite(out_dir: str | os.PathLike[str], *, measuring: bool) -> None:
    """Refuse, before any work, a simulation-only run that would replace a measured table in
    `out_dir`: measured numbers are only ever replaced by measured numbers."""
    path = Path(out_dir) / "throughput_table.json"
    if measuring or not path.exists():
        return
    try:
        existing = read_json(path)
    except (OSError, ValueError):
        return
    if has_measured(existing):
        raise FileExistsError(
            f"{path} holds measured numbers, and this run simulates only (--no-measure): it would "
            "replace them with a table that has none. Write it elsewhere with --out DIR, or run "
            "with measurement (`make throughput-table`).")


def write_outputs(payload: dict[str, Any], out_dir: str | os.PathLike[str],
                  log_wandb: bool = True) -> list[Path]:
    """Write the JSON, the markdown and the figures of a throughput table; log them to W&B.
    Refuses to replace a measured table with a simulation-only one (:func:`check_overwrite`)."""
    check_overwrite(out_dir, measuring=has_measured(payload))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_speedups(payload["table2"], out / "speedup.png")]
    if payload.get("bubble_curves"):
        written.append(plot_bubble(payload["bubble_curves"], out / "bubble.png"))
    if payload.get("gantt"):
        gantt_png = draw_gantt(Timeline.from_json(payload["gantt"]["timeline"]), out / "gantt.png",
                               payload["gantt"]["caption"])
        if gantt_png is not None:
            payload["gantt"]["file"] = gantt_png.name
            written.append(gantt_png)
        else:
            payload["gantt"] = None
    measured = payload.get("timelines", {}).get("transformer", {})
    key = "K2_M4" if "K2_M4" in measured else next(iter(measured), None)
    if key is not None:
        png = draw_gantt(Timeline.from_json(measured[key]), out / "gantt_measured.png",
                         f"Measured transformer step, {key.replace('_', ', ')}, 2 stage processes")
        if png is not None:
            payload["gantt_measured"] = {"file": png.name, "config": key}
            written.append(png)
    json_path = write_json(out / MANIFEST, {**payload, "written_by": COMMAND})
    payload = read_json(json_path)        # with the environment write_json embedded
    validation_path = out / "validation.json"
    validation = read_json(validation_path) if validation_path.exists() else None
    md = write_markdown(out / "throughput_table.md", render_markdown(payload, validation))
    written = [json_path, md, *written]
    if log_wandb:
        log_to_wandb(payload, written)
    return written


def draw_gantt(timeline: Any, path: Path, title: str) -> Path:
    """The Gantt chart of a timeline, written to `path`."""
    return gantt.render_gantt(timeline, path, title=title)


def log_to_wandb(payload: dict[str, Any], files: Sequence[Path]) -> None:
    """Tables, figures and the targets to W&B (offline by default) through RunLogger."""
    with RunLogger("gpipe-repro", config=payload["settings"],
                   dir=results_root() / "runs" / "throughput-table",
                   name="throughput-table", tags=["throughput"]) as run:
        headers = ["model", "K", "M", "balance", "simulated_normalized", "measured_normalized",
                   "measured_host", "measured_idle_fraction", "paper", "torchgpipe",
                   "flop_model_normalized"]
        for table in ("table2", "table3"):
            rows = [[m, r["K"], r["M"], str(r["balance"]), r["simulated"]["normalized"],
                     (r.get("measured") or {}).get("normalized"), _host_label(r.get("measured")),
                     (measured_host(r["measured"]) or {}).get("idle_fraction_before")
                     if r.get("measured") else None,
                     r.get("paper"), r.get("torchgpipe"), (r.get("flop_model") or {}).get("normalized")]
                    for m, rs in payload[table].items() for r in rs]
            run.log_table(table, headers, rows)
        for f in files:
            if f.suffix == ".png":
                run.log_image(f.stem, f)
        run.summary({f"{c['model']}_K8_M32_simulated": c["simulated"] for c in payload["claims"]})


def _host_label(meas: dict[str, Any] | None) -> str | None:
    """"clean" / "BUSY ..." for a measured cell in W&B (None for a simulated-only cell)."""
    if not meas:
        return None
    note = measured_note(meas, normalized=True)
    if "normalized_figure" in meas:
        return f"95% interval {note.strip()}"
    return "clean" if not note else note.strip().replace(BUSY_MARK, "BUSY ")


def run_with_progress(settings: SweepSettings, out_dir: str | os.PathLike[str],
                      log_wandb: bool = True, *, command: dict[str, Any] | None = None,
                      cuts_from: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """:func:`run_throughput_table` under a rich progress bar on a terminal (elsewhere a plain line at
    least every 30 s), then :func:`write_outputs`.

    `command` ({"prog", "argv"}) is recorded in the payload, so the page says how it was made.
    `cuts_from`: an earlier throughput_table.json whose cuts are kept where the new costs cannot tell
    them from their best (:mod:`gpipe_repro.repro.throughput.kept_cuts`); recorded in the payload."""
    check_overwrite(out_dir, measuring=settings.measure)
    import contextlib

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    measure = distributed_measure(settings) if settings.measure else None
    console = Console(stderr=True)
    if settings.measure and measure is None:
        console.print("[yellow]the distributed runtime (gpipe_repro.distributed) is not available: "
                      "every number will be simulated[/yellow]")
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    from gpipe_repro.report.measurement import Progress as PlainProgress
    plain = None if console.is_terminal else PlainProgress("throughput table", stream=sys.stderr)
    with Progress(*columns, console=console) as bar, plain or contextlib.nullcontext():
        task = bar.add_task("throughput table", total=plan_steps(settings, measure is not None))
        started = False

        def step(message: str) -> None:
            nonlocal started
            bar.update(task, advance=1 if started else 0, description=message)
            if plain is not None:
                plain.update(message)
            started = True

        previous = read_json(cuts_from) if cuts_from is not None else None
        payload = run_throughput_table(settings, step, measure, previous=previous)
        payload["cuts_from"] = None if cuts_from is None else display_path(cuts_from)
        if command is not None:
            payload["command"] = command
        step("writing results")
        files = write_outputs(payload, out_dir, log_wandb=log_wandb)
        bar.update(task, completed=bar.tasks[0].total)
    for f in files:
        console.print(f"wrote {f}")
    return payload

