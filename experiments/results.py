"""`make results`: every table and validation page of record regenerated from a clean commit, in one
run of at most 45 minutes on the project's 2-core host.

The parts are the make targets' own entry points (``python -m experiments.X``, which pass
``record=True`` and so replace their earlier results of record), run one after another in
:data:`PARTS` order, each a child process with a wall-clock limit (:mod:`.timed_parts`). The
benchmarks get a ``--budget`` (their measuring time, shared by their groups) well inside that limit;
the limits add up to no more than :data:`TOTAL_LIMIT_S`. The training runs are not part of it.

Before any work the checkout must be clean: a tracked file outside results/ that differs from the
commit is refused, by name (the stamps would name a commit that did not produce the numbers). Then
every file a part wrote under its output folders is stamped with the commit and the host
(:mod:`.result_stamps`), and ``results/regenerated.json`` lists the parts (status, seconds) and the
files. A part that fails or runs out of time is recorded and the run goes on; the exit status is 1
when any part did not finish. ``--dry-run`` prints the plan: each part's limit and command.
"""
from __future__ import annotations

import datetime as _dt
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import typer

from experiments.timed_parts import Outcome, Part, check_parts, plan_lines, run_part

COMMAND = "make results"
TOTAL_LIMIT_S = 45 * 60.0
MANIFEST = "regenerated.json"


def _python(module: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", module, *args)


#: (name, entry point and options, wall-clock limit in seconds, folders under results/ it writes).
#: The benchmarks' --budget is their measuring time; the limit leaves room for start-up, the rounds
#: the stop rule needs at least, and output. Sized from make results on this host (seconds, the
#: range seen, a slow hour's in parentheses): throughput-table 703-760 (906; calibration, at most 10
#: rounds per model in at most 270 s, then about 140 s of pages and charts: --time-limit makes its
#: measured rounds share what its calibrations leave), validate-sim 429-547 (3 rounds, calibrated in
#: each), validate-unseen 308-411 (over 450: the two validations stop after a round where the next
#: would not fit their --budget, and a round ends at the first configuration that would end past
#: it), memory-table 95-119 (135; 160, past its limit, on a slow hour), bench-overhead 34-58, bench-
#: runtime 140-163, bench-schedules 108-116, bench-replicas 80-85, replicas-plan 24-34 (45), regression
#: detector 63-75. ``--only`` (``make results ONLY=...``) reruns a part that ran out of time.
PARTS: tuple[Part, ...] = (
    Part("throughput-table", _python("experiments.throughput_table", "--time-limit", "790"), 830,
         ("throughput",),
         "K x M normalized throughput, measured and simulated"),
    Part("validate-sim", _python("experiments.validate_simulator", "--ms", "2,8", "--steps", "2",
                                 "--rounds", "3", "--budget", "560"), 600,
         ("throughput",), "simulator vs real stage processes, M = 2 and 8, every configuration in 3 "
         "interleaved rounds (fewer where they would not fit --budget), calibrated in each; "
         "re-renders throughput_table.md"),
    Part("validate-unseen", _python("experiments.validate_unseen", "--ms", "2,8", "--steps", "2",
                                    "--rounds", "3", "--repeats", "8", "--in-situ-m", "4",
                                    "--budget", "390"), 420,
         ("throughput",), "three models the simulator was never tuned on, K=2, M = 2 and 8, each "
         "also corrected in situ, in 3 interleaved rounds (fewer where they would not fit --budget), "
         "calibrated in each"),
    Part("memory-table", _python("experiments.memory_table"), 190, ("memory",)),
    Part("bench-overhead", _python("experiments.bench_overhead", "--budget", "50"), 65, ("overhead",)),
    Part("bench-runtime", _python("experiments.bench_runtime", "--budget", "60"), 175, ("runtime",)),
    Part("bench-schedules", _python("experiments.bench_schedules", "--budget", "60"), 150,
         ("schedules",)),
    Part("bench-replicas", _python("experiments.bench_replicas", "--budget", "70"), 100, ("replicas",)),
    Part("replicas-plan-table", _python("experiments.replicas_plan_table"), 75, ("replicas",)),
    Part("check-regression-detector", _python("experiments.check_regression_detector", "--runs", "1"),
         90, ("ci",), "1 run per condition (make check-regression-detector runs 10)"),
)

#: Pages of record that run only when named (``make results ONLY=versus-torch``): each alone takes
#: much of the 45 minutes, so the full run leaves them out; named, they are checked, run and stamped
#: like the others (their own make targets write the same files, unstamped).
ON_REQUEST: tuple[Part, ...] = (
    Part("throughput-reproducibility", _python("experiments.throughput_reproducibility"), 1500,
         ("throughput",), "two consecutive simulated tables, each calibrated afresh"),
    Part("versus-torch", _python("experiments.versus_torch", "--budget", "600"), 1500, ("schedules",),
         "ours against torch.distributed.pipelining, best schedule against best"),
    Part("bench-zero-bubble", _python("experiments.bench_zero_bubble", "--budget", "400"), 900,
         ("schedules",), "zb-h1 and zb-v against 1F1B on every validation model"),
    Part("bench-compile", _python("experiments.bench_compile", "--budget", "150"), 600, ("compile",),
         "GPipe(compile=True) and torch.compile against eager"),
)


class DirtyCheckout(RuntimeError):
    """The checkout has changes the stamps could not name (the message lists them)."""


def require_clean(repo: Path) -> str:
    """The commit of `repo`, or :class:`DirtyCheckout` when tracked files outside results/ differ
    from it (or git cannot say)."""
    from gpipe_repro.report.provenance import _git, changed_files
    commit = _git("rev-parse", "HEAD", repo=repo)
    changed = changed_files(repo)
    if commit is None or changed is None:
        raise DirtyCheckout(f"{COMMAND}: {repo} is not a git checkout git can read; results of record are "
                            "regenerated from a commit")
    if changed:
        shown = ", ".join(changed[:10]) + (f" and {len(changed) - 10} more" if len(changed) > 10 else "")
        raise DirtyCheckout(f"{COMMAND} refuses a dirty tree: {len(changed)} tracked file(s) differ from "
                            f"commit {commit[:12]} ({shown}); commit or stash them first, so that every "
                            "stamp names the code that produced the numbers")
    return commit


def host_facts() -> dict[str, Any]:
    import socket

    from gpipe_repro.report.host import usable_cores
    from gpipe_repro.report.provenance import cpu_model
    return {"hostname": socket.gethostname(), "cpu": cpu_model(), "cores": usable_cores()}


def _files_under(root: Path, folders: Sequence[str]) -> dict[Path, int]:
    out = {}
    for folder in folders:
        base = root / folder
        if base.is_dir():
            for p in base.rglob("*"):
                if p.is_file() and not p.name.startswith("."):
                    out[p] = p.stat().st_mtime_ns
    return out


def regenerate(parts: Sequence[Part], *, repo: Path, results: Path, out: TextIO | None = None,
               progress_every: float = 30.0, total_limit_s: float = TOTAL_LIMIT_S,
               merge: bool = False) -> dict[str, Any]:
    """Check the checkout and the plan, run every part in order, stamp what each wrote; returns this
    run's manifest, written to `results`/regenerated.json (`merge`: into the one there, see
    :func:`merged`)."""
    from experiments.result_stamps import make_stamp, stamp_file

    check_parts(parts, total_limit_s)
    commit = require_clean(repo)
    stream = out or sys.stdout
    host = host_facts()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPIPE_REPRO_RESULTS": str(results)}
    # its numbers are the parts' wall-clock seconds on this host: measured
    manifest: dict[str, Any] = {"command": COMMAND, "method": "measured", "commit": commit, "host": host,
                                "total_limit_s": total_limit_s, "parts": [], "files": {}}
    for i, part in enumerate(parts):
        header = f"results {i + 1}/{len(parts)} "
        stream.write(f"{header}{part.name}: start (limit {part.limit_s:.0f} s): {part.command_line()}\n")
        stream.flush()
        before = _files_under(results, part.outputs)
        outcome: Outcome = run_part(part, cwd=repo, env=env, out=stream, progress_every=progress_every,
                                    header=header)
        written = sorted(p for p, m in _files_under(results, part.outputs).items() if before.get(p) != m)
        stamp = make_stamp(command=COMMAND, part=part.name, commit=commit, host=host,
                           time_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                           status=outcome.status)
        for path in written:
            how = stamp_file(path, stamp)
            manifest["files"][str(path.relative_to(results))] = {"part": part.name, "stamp": how}
        manifest["parts"].append({**outcome.to_json(), "limit_s": part.limit_s,
                                  "command": part.command_line(), "files_written": len(written)})
        stream.write(f"{header}{part.name}: {outcome.status} in {outcome.seconds:.0f} s, "
                     f"{len(written)} file(s) stamped\n")
        stream.flush()
    from gpipe_repro.report.records import write_json
    for part in manifest["parts"]:
        part["commit"] = commit
    write_json(results / MANIFEST, merged(results / MANIFEST, manifest) if merge else manifest)
    return manifest


def merged(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """A run of some parts (``--only``) into the earlier manifest at `path`: those parts' entries and
    files replaced by this run's. Each part names the commit it ran at; "commit" is this run's,
    "commits" every one the parts name."""
    if not path.exists():
        return manifest
    names = {p["name"] for p in manifest["parts"]}
    from gpipe_repro.report.records import read_json
    earlier = read_json(path)
    for part in earlier.get("parts", []):
        part.setdefault("commit", earlier.get("commit"))
    parts = {p["name"]: p for p in earlier.get("parts", [])}
    parts.update({p["name"]: p for p in manifest["parts"]})
    files = {f: v for f, v in earlier.get("files", {}).items() if v.get("part") not in names}
    files.update(manifest["files"])
    order = {p.name: i for i, p in enumerate(PARTS + ON_REQUEST)}
    return {**manifest, "commits": sorted({p["commit"] for p in parts.values() if p.get("commit")}),
            "parts": sorted(parts.values(), key=lambda p: order.get(p["name"], len(order))), "files": files}


def chosen(only: Sequence[str]) -> tuple[Part, ...]:
    """The parts named in `only` (every part of :data:`PARTS` when empty), in plan order, those of
    :data:`ON_REQUEST` after them; an unknown name is refused."""
    names = [p.name for p in PARTS + ON_REQUEST]
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise ValueError(f"{COMMAND}: unknown part(s) {', '.join(unknown)}: ONLY= takes {', '.join(names)}")
    return tuple(p for p in PARTS if not only or p.name in only) + tuple(p for p in ON_REQUEST
                                                                         if p.name in only)


def main(*, dry_run: bool = False, only: Sequence[str] = ()) -> None:
    """The plan (`dry_run`), or every part regenerated (`only`: those named, their entries replaced
    in the manifest); exits with a one-line reason on a dirty checkout, and with status 1 if a part
    did not finish."""
    from gpipe_repro.report.provenance import _REPO_ROOT
    repo = _REPO_ROOT
    try:
        parts = chosen(only)
        check_parts(parts, TOTAL_LIMIT_S)
        if dry_run:
            print("\n".join(plan_lines(parts, TOTAL_LIMIT_S)))
            return
        manifest = regenerate(parts, repo=repo, results=repo / "results", merge=bool(only))
    except (DirtyCheckout, ValueError) as e:
        sys.exit(str(e))
    failed = [p["name"] for p in manifest["parts"] if p["status"] != "ok"]
    print(f"{COMMAND}: {len(manifest['parts']) - len(failed)} of {len(manifest['parts'])} parts finished, "
          f"{len(manifest['files'])} files stamped at commit {manifest['commit'][:12]}"
          + (f"; did not finish: {', '.join(failed)}" if failed else ""))
    if failed:
        sys.exit(1)


app = typer.Typer(add_completion=False)


@app.command()
def cli(dry_run: bool = typer.Option(False, "--dry-run", help="print each part's limit and command; "
                                      "run nothing"),
        only: str = typer.Option("", help="comma-separated parts to regenerate (default: all), e.g. "
                                 "throughput-table to rerun one that ran out of time")) -> None:
    """Every table and validation page of record, regenerated from a clean commit (<= 45 minutes)."""
    main(dry_run=dry_run, only=[p.strip() for p in only.split(",") if p.strip()])


if __name__ == "__main__":
    app()
