"""`make device-results`: what a lent GPU host (one GPU, 16 CPU cores) can add to the results, in at
most 8 minutes, with that machine's own torch and nothing installed.

In order, each part a child process with a wall-clock limit (:mod:`.timed_parts`; the parts are
:mod:`.device_parts`): the host's speed stability (the probe every measurement reads), gpu-check,
validate-sim at K = 2, 4 and 8 with real stage processes on the CPU cores, bench-schedules at K = 4,
bench-replicas at R = 2 and 4. A part that fails or runs out of time is recorded, and the run goes
on. What comes back is at most three files in the output folder (``$OUT`` when set, else
results/hosts/<host>/): ``summary.json`` (every part's status, seconds and figures), ``summary.md``,
and ``parts.tar.gz`` (every file the parts wrote), each stamped with the commit and the host
(:mod:`.result_stamps`). ``--tiny``: toy sizes on the CPU, K = 2 and R = 2 only, no GPU (what the
test suite runs); ``--dry-run`` prints the plan.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import socket
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Optional

import typer

from experiments.timed_parts import Part, check_parts, plan_lines, run_part

COMMAND = "make device-results"
TOTAL_LIMIT_S = 8 * 60.0
PARTS_LIMIT_S = 440.0          # the rest of the 8 minutes: start-up, packing
TINY_LIMIT_S = 240.0
FILES = ("summary.json", "summary.md", "parts.tar.gz")

#: (part, limit in seconds) on the lent host, in order. Sized from an H200 host's runs (16 Xeon
#: cores, 2026-11-26): host-speed 19 s, gpu-check 55, validate-sim 51-54 per K, bench-schedules-k4 50,
#: bench-replicas 44, bench-compile 88 (with a 25 s budget; here 15). Each stage-process job starts
#: CUDA-built torch in every process, ~10 s before the first step. A part that runs out of time is
#: recorded; ``--only`` reruns it.
FULL = (("host-speed", 18), ("gpu-check", 62), ("validate-sim-k2", 55), ("validate-sim-k4", 55),
        ("validate-sim-k8", 60), ("bench-schedules-k4", 55), ("bench-replicas", 50), ("bench-compile", 85))
TINY = (("host-speed", 20), ("gpu-check", 60), ("validate-sim-k2", 60), ("bench-schedules-k2", 45),
        ("bench-replicas", 45))


def plan(work: Path, *, tiny: bool, only: tuple[str, ...] = ()) -> tuple[Part, ...]:
    """The parts, each ``python -m experiments.device_parts PART --work WORK``; `only`: those named."""
    table = TINY if tiny else FULL
    unknown = sorted(set(only) - {name for name, _ in table})
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(unknown)}: --only takes "
                         f"{', '.join(name for name, _ in table)}")
    flag = ("--tiny",) if tiny else ()
    return tuple(Part(name, (sys.executable, "-m", "experiments.device_parts", name, "--work",
                             str(work), *flag), float(limit)) for name, limit in table
                 if not only or name in only)


def host_slug() -> str:
    """results/hosts/<this>: the GPU's name when torch sees one, else the host name."""
    name = socket.gethostname()
    try:
        import torch
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:80] or "host"


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    from gpipe_repro.report.records import results_root
    return results_root() / "hosts" / host_slug()


def check_out(out: Path) -> None:
    """Refuse an output folder holding anything but a previous device-results output."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file: give --out a folder")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in FILES)
        if foreign:
            raise ValueError(f"{out} holds files {COMMAND} did not write ({', '.join(foreign[:5])}): "
                             "give an empty or new --out")


def render(summary: dict[str, Any]) -> str:
    lines = [f"# Device results: {summary['host']['slug']}", "",
             f"{summary['host']['cpu']}, {summary['host']['cores']} usable cores"
             + (f", {summary['host']['gpu']}" if summary['host'].get("gpu") else "")
             + f"; torch {summary['host'].get('torch')}"
             + (" (TINY RUN: not of record)" if summary["tiny"] else ""),
             "", "| part | status | seconds | limit s |", "|---|---|---:|---:|"]
    for p in summary["parts"]:
        lines.append(f"| {p['name']} | {p['status']} | {p['seconds']:.0f} | {p['limit_s']:.0f} |")
    speed = (summary["figures"].get("host-speed") or {}).get("fast_share")
    if speed:
        lines += ["", f"Host speed: fast share {speed['mean']:.2f} (min {speed['min']:.2f}, max "
                      f"{speed['max']:.2f}) over {speed['readings']} readings in {speed['seconds']:.0f} s."]
    lines += ["", "Every part's figures: summary.json; every file the parts wrote: parts.tar.gz."]
    return "\n".join(lines)


def _host() -> dict[str, Any]:
    from gpipe_repro.report.host import usable_cores
    from gpipe_repro.report.provenance import cpu_model
    info: dict[str, Any] = {"hostname": socket.gethostname(), "cpu": cpu_model(), "cores": usable_cores(),
                            "slug": host_slug(), "gpu": None, "torch": None}
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def device_results(out: Path, *, tiny: bool, progress_every: float = 30.0,
                   only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the plan into a scratch folder, then write the three files into `out`; the summary."""
    from experiments.result_stamps import make_stamp, stamp_file
    from gpipe_repro.report.provenance import git_state
    from gpipe_repro.report.records import write_json, write_markdown

    check_out(out)
    with tempfile.TemporaryDirectory(prefix="device-results-") as scratch:
        work = Path(scratch) / "parts"
        parts = plan(work, tiny=tiny, only=only)
        check_parts(parts, TINY_LIMIT_S if tiny else PARTS_LIMIT_S)
        repo = Path(__file__).resolve().parents[1]
        # The stage-process parts run on the CPU cores by design: say so, rather than warn per process.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPIPE_REPRO_BACKEND": "gloo",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
        host, state = _host(), git_state()
        summary: dict[str, Any] = {"command": COMMAND, "method": "measured (each part's result.json says "
                                   "how its figures were made)", "tiny": tiny, "only": list(only),
                                   "host": host, **state,
                                   "parts": [], "figures": {}, "written_by": COMMAND}
        for i, part in enumerate(parts):
            print(f"device-results {i + 1}/{len(parts)} {part.name}: start (limit {part.limit_s:.0f} s)",
                  flush=True)
            outcome = run_part(part, cwd=repo, env=env, progress_every=progress_every,
                               header=f"device-results {i + 1}/{len(parts)} ")
            result_file = work / part.name / "result.json"
            if result_file.exists():
                summary["figures"][part.name] = json.loads(result_file.read_text())
            summary["parts"].append({**outcome.to_json(), "limit_s": part.limit_s})
            print(f"device-results {part.name}: {outcome.status} in {outcome.seconds:.0f} s", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out / "parts.tar.gz", "w:gz") as tar:
            if work.exists():
                tar.add(work, arcname="parts")
    stamp = make_stamp(command=COMMAND, part=",".join(only) or "all", commit=state.get("git_commit"),
                       host=host,
                       time_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    write_json(out / "summary.json", summary)
    write_markdown(out / "summary.md", render(summary))
    for name in ("summary.json", "summary.md"):
        stamp_file(out / name, stamp)
    return summary


def main(*, tiny: bool = False, out: Path | None = None, dry_run: bool = False,
         only: tuple[str, ...] = ()) -> None:
    """The plan (`dry_run`), or its parts (`only`: those named) run into `out` (default
    :func:`default_out`); exits with status 1 if a part did not finish."""
    limit = TINY_LIMIT_S if tiny else PARTS_LIMIT_S
    try:
        parts = plan(Path("<scratch>"), tiny=tiny, only=only)
        check_parts(parts, limit)
        if dry_run:
            print("\n".join(plan_lines(parts, limit)))
            return
        summary = device_results(out or default_out(), tiny=tiny, only=only)
    except ValueError as e:
        sys.exit(f"{COMMAND}: {e}")
    failed = [p["name"] for p in summary["parts"] if p["status"] != "ok"]
    print(f"{COMMAND}: {len(summary['parts']) - len(failed)} of {len(summary['parts'])} parts finished"
          + (f"; did not finish: {', '.join(failed)}" if failed else ""), flush=True)
    if failed:
        sys.exit(1)


app = typer.Typer(add_completion=False)


@app.command()
def cli(tiny: bool = typer.Option(False, "--tiny", help="toy sizes on the CPU, K=2 and R=2 only, no GPU"),
         out: Optional[Path] = typer.Option(None, help="output folder (default: $OUT, else "
                                            "results/hosts/<host>/)"),
         dry_run: bool = typer.Option(False, "--dry-run", help="print the plan; run nothing"),
         only: str = typer.Option("", help="comma-separated parts to run (default: all), e.g. "
                                  "bench-replicas,bench-compile to rerun those that did not finish")) -> None:
    """A lent GPU host: host speed, gpu-check, validate-sim K=2/4/8, schedules K=4, replicas R=2/4,
    torch.compile."""
    main(tiny=tiny, out=out, dry_run=dry_run, only=tuple(p.strip() for p in only.split(",") if p.strip()))


if __name__ == "__main__":
    app()
