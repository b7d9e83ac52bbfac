"""`make validate-sim`: the pipeline simulator against real stage processes.

The same configurations are simulated (calibrated per-layer costs, the host's measured gloo link,
the schedule the runtimes execute) and measured (the distributed runtime, one process per stage, 1
thread each): K=2 here (K up to 8 on a host with >= 16 cores), M in {1, 2, 4, 8, 16},
re-materialization on and off, both models of the throughput table, and the schedules GPipe, 1F1B and
ZB-H1, interleaved 1F1B and ZB-V on the same cuts. Reports the relative error of simulated against
measured throughput, overall and per schedule, each with the interval the measured steps give it
(:mod:`gpipe_repro.repro.throughput.simulator_error`); every configuration is measured once per
round in interleaved rounds (:data:`ROUNDS`), so that its steps span the host's states over the
whole validation. Targets: median |error| <= 5%, worst <= 10%, judged met / not met / inconclusive
(a busy host widens the intervals; nothing waits for it to be idle).

Nothing is fitted to these measurements: costs come from the calibration (each layer timed alone,
in this process, with the runtime's thread count) and the link from a ping-pong.

Writes results/throughput/validation.{json,md} and a measured/simulated Gantt pair of one
configuration, and refreshes results/throughput/throughput_table.md (which shows the error);
results/ is $GPIPE_REPRO_RESULTS when set, or --out DIR. An earlier validation there is replaced
only with --overwrite; a file the command did not write is never replaced; the results of record
(the checkout's results/) are replaced only with --record (what `make validate-sim` gives). The command
line is `gpipe-repro validate-sim` (gpipe_repro/commands/throughput.py).
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from gpipe_repro.report.host import usable_cores
from gpipe_repro.report.output_guard import OutputRefused, check_outputs, owned_json
from gpipe_repro.report.records import results_root
from gpipe_repro.repro.throughput import (
    MODELS,
    VALIDATION_MS,
    VALIDATION_SCHEDULES,
    SweepSettings,
    distributed_measure,
    draw_gantt,
    render_markdown,
    render_validation_summary,
    validate_simulator,
)
from gpipe_repro.repro.throughput import outputs as table_outputs
from gpipe_repro.repro.throughput.validation import unvalidated_note

DEFAULTS = SweepSettings(checkpoint="always", recompute_ahead=False, link="gloo-loopback",
                         device="cpu", threads=1, measure_steps=8)


#: Rounds per configuration: each measured once per round, the rounds interleaved across configurations.
ROUNDS = 3

COMMAND = "validate-sim"
MANIFEST = "validation.json"
PAGES = ("validation.md",)
GANTTS = ("validation_gantt_measured.png", "validation_gantt_simulated.png")


def is_validation(data: object) -> bool:
    """A validation.json written before outputs were stamped."""
    return isinstance(data, dict) and {"rows", "summary"} <= set(data)


def check_out_dir(out: Path, *, overwrite: bool, record: bool = False,
                  render_only: bool = False) -> None:
    """Refuse, before any work, to replace a file in `out` that this command did not write (its
    validation.json says which are its own; throughput_table.md, which it refreshes, belongs to the
    throughput table beside it), or its own without --overwrite, or the results of record without
    --record (what `make validate-sim` gives). See :func:`gpipe_repro.report.output_guard.check_outputs`."""
    if out.exists() and not out.is_dir():
        raise OutputRefused(f"--out {out} is a file, not a directory: give a directory")
    files = [out / name for name in PAGES]
    if not render_only:
        files += [out / MANIFEST, *(out / name for name in GANTTS)]
    if (out / table_outputs.MANIFEST).exists():
        files.append(out / "throughput_table.md")

    def own(path: Path) -> bool:
        if path.name == "throughput_table.md":
            return table_outputs.owns(out)
        return owned_json(out / MANIFEST, COMMAND, is_validation)

    check_outputs(files, command=COMMAND, option="--out", overwrite=overwrite, own=own,
                  make_target=COMMAND, record=record)


def render_pages(out: Path) -> None:
    """validation.md from validation.json, and throughput_table.md (which includes its summary)."""
    from gpipe_repro.report.records import read_json, write_markdown

    path = out / "validation.json"
    if not path.exists():
        sys.exit(f"error: no {path}: run `make validate-sim` first")
    result = read_json(path)
    ks_run = sorted({r["K"] for r in result["rows"]})
    cores = int(result.get("environment", {}).get("cores") or usable_cores())
    text = ["# Simulator validation", "", render_validation_summary(result), "",
            unvalidated_note(ks_run, cores), "",
            f"Gantt charts of `{result.get('gantt_config')}`: "
            "![measured](validation_gantt_measured.png) ![simulated](validation_gantt_simulated.png)"]
    write_markdown(out / "validation.md", "\n".join(text))
    table = out / "throughput_table.json"
    if table.exists():
        write_markdown(out / "throughput_table.md", render_markdown(read_json(table), result))


def main(*, models: Sequence[str] = MODELS, ms: Sequence[int] = VALIDATION_MS,
         ks: Sequence[int] | None = None,
         schedules: Sequence[str] = VALIDATION_SCHEDULES, steps: int = DEFAULTS.measure_steps,
         rounds: int = ROUNDS, out: Path | None = None, overwrite: bool = False, record: bool = False,
         render_only: bool = False, budget: float | None = None) -> None:
    """Check the options and the output directory (before any work), validate, write.

    `out` defaults to results/throughput (under $GPIPE_REPRO_RESULTS when set); `record` lets the run
    replace the results of record (what `make validate-sim` gives); `budget`: seconds the rounds
    end within (:func:`gpipe_repro.report.measurement.another_round` and ``item_fits``).

    Raises:
        ValueError: an option this host or these models cannot take (the message names the fix).
        OutputRefused: `out` holds what this run may not replace.
    """
    out = out if out is not None else results_root() / "throughput"
    bad = [n for n in schedules if n not in VALIDATION_SCHEDULES] + [n for n in models if n not in MODELS]
    if bad:
        raise ValueError(f"unknown {', '.join(bad)}: the schedules are {', '.join(VALIDATION_SCHEDULES)}, "
                         f"the models {', '.join(MODELS)}")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if budget is not None and not budget > 0:
        raise ValueError(f"--budget must be > 0 seconds, got {budget}")
    cores = usable_cores()
    too_big = [k for k in (ks or []) if k > cores]
    if too_big:
        raise ValueError(f"K={too_big} needs more stage processes than the {cores} usable cores; "
                         f"use --ks with values <= {cores}")
    if render_only and not (out / MANIFEST).exists():
        raise ValueError(f"--render-only: no {out / MANIFEST}: run `make validate-sim` first (or give "
                         "the --out that holds it)")
    check_out_dir(out, overwrite=overwrite, record=record, render_only=render_only)
    if render_only:
        render_pages(out)
        return

    from rich.console import Console

    from gpipe_repro.engine.timeline import Timeline
    from gpipe_repro.report.measurement import Progress
    from gpipe_repro.report.records import write_json
    from gpipe_repro.sim import in_situ

    settings = replace(DEFAULTS, measure_steps=steps)
    measure = distributed_measure(settings)
    console = Console(stderr=True)
    level = functools.partial(in_situ.level, objective=settings.objective)
    with Progress(COMMAND) as shown:
        result = validate_simulator(
            settings, measure, models=list(models), ks=list(ks) if ks else None, ms=list(ms),
            schedules=list(schedules),
            measure_schedule=distributed_measure,
            progress=shown.update, rounds=rounds, budget_s=budget, level=level)
    timelines = result.pop("timelines")
    if timelines:
        key = next((k for k in timelines if "_M4_always" in k), next(iter(timelines)))
        for kind in ("measured", "simulated"):
            draw_gantt(Timeline.from_json(timelines[key][kind]), out / f"validation_gantt_{kind}.png",
                       f"{kind}: {key.replace('_', ' ')}")
        result["gantt_config"] = key
    write_json(out / MANIFEST, {**result, "written_by": COMMAND})
    render_pages(out)
    from gpipe_repro.repro.throughput.simulator_error import describe
    console.print(describe(result["summary"]))
    for name, p in result["summary"].get("per_schedule", {}).items():
        console.print(f"  {name}: {describe(p)}")

