"""`make check-regression-detector`: show that the CI speedup regression passes a healthy tree and
fails a broken one.

It runs tests/repro/test_speedup_regression.py N times in each condition, on a private copy of the tree
(your checkout is never modified):

- ``healthy, CPU hog``: the tree as is, with one extra process spinning on a core for the whole run
  (the "one other busy process" that made the old wall-clock check fail healthy runs);
- ``schedule serialized``: the distributed runtime holds one lock, shared by all stage processes,
  around every compute action, so no two stages ever compute at once (every action still runs, in
  schedule order);
- ``one core``: every stage process pins itself to one core (the first it may use);
- ``equal partitions``: the partitioner ignores costs and cuts equal layer counts;
- ``recompute doubled``: each RECOMPUTE runs the cell's forward twice.

It writes results/ci/regression_detector.{json,md}: per condition, how many runs the whole check
passed, per check how many runs it passed, and the values each timeline check measured (how far
healthy and broken runs sit from the thresholds), with the host load of every run.

    python -m experiments.check_regression_detector --runs 10
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from gpipe_repro.report.host import host_idle_fraction, usable_cores
from gpipe_repro.report.output_guard import OutputRefused, check_manifest_outputs, stamp
from gpipe_repro.report.provenance import host_block
from gpipe_repro.report.records import markdown_table, read_json, results_root, write_json, write_markdown

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/repro/test_speedup_regression.py"
OUT = results_root() / "ci"     # $GPIPE_REPRO_RESULTS/ci when set
COMMAND = "check-regression-detector"


@dataclass(frozen=True)
class Mutation:
    """A breakage: the regular expression `pattern` (multi-line mode; it must match exactly once in
    `path`, whatever the indentation) is replaced by `replacement` (``\\1`` etc. refer to groups)."""

    name: str
    path: str
    pattern: str
    replacement: str
    what: str


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "schedule serialized", "gpipe_repro/distributed/runtime.py",
        # the compute actions' call in the runtime's `run` (not the AGREE barrier's)
        r"^([ \t]*)by_stage\[a\.stage\]\.execute\(a\)\n(?=\1if reducer is not None)",
        "\\1if a.kind in COMPUTE:\n"
        "\\1    import fcntl\n"
        "\\1    _lock = open('/tmp/gpipe-repro-mutation-serialize.lock', 'w')\n"
        "\\1    fcntl.flock(_lock, fcntl.LOCK_EX)\n"
        "\\1by_stage[a.stage].execute(a)\n"
        "\\1if a.kind in COMPUTE:\n"
        "\\1    _lock.close()\n",
        "one lock held by every stage process around each compute action"),
    Mutation(
        "one core", "gpipe_repro/distributed/measure.py",
        r"^([ \t]*)built = layers\(\) if callable\(layers\) else layers\n",
        "\\1os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "\\1built = layers() if callable(layers) else layers\n",
        "every stage process pins itself to the same core"),
    Mutation(
        "equal partitions", "gpipe_repro/engine/partition.py",
        r"^([ \t]*)n = len\(costs\)\n(?=\1if partitions < 1:)",
        "\\1n = len(costs)\n\\1objective, memory, memory_cap, first = 'equal', None, None, None\n",
        "the partitioner cuts equal layer counts whatever the costs"),
    Mutation(
        "recompute doubled", "gpipe_repro/engine/stage.py",
        r"^([ \t]*)(self\.graphs\[m\] = )(self\._run\(self\.inputs\[m\], m[^\n]*\))\n",
        "\\1\\3\n\\1\\2\\3\n",
        "each RECOMPUTE runs the cell's forward twice"),
)
HEALTHY = "healthy, CPU hog"
HEALTHY_WHAT = "the tree as is, with one process spinning on a core"
CONDITIONS = (HEALTHY, *(m.name for m in MUTATIONS))


def copy_tree(dest: Path, mutation: Mutation | None) -> Path:
    """The package, the tests, the experiments and the baseline copied to `dest`, with `mutation` applied."""
    for part in ("gpipe_repro", "tests", "experiments"):
        shutil.copytree(ROOT / part, dest / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for f in ("pyproject.toml",):
        shutil.copy2(ROOT / f, dest / f)
    (dest / "results" / "baselines").mkdir(parents=True)
    shutil.copy2(ROOT / "results" / "baselines" / "speedups.json",
                 dest / "results" / "baselines" / "speedups.json")
    if mutation is not None:
        target = dest / mutation.path
        text, count = re.subn(mutation.pattern, mutation.replacement, target.read_text(),
                              flags=re.MULTILINE)
        if count != 1:
            raise RuntimeError(f"mutation {mutation.name!r} no longer applies: its pattern matches "
                               f"{count} times in {mutation.path} (update MUTATIONS in "
                               "experiments/check_regression_detector.py)")
        target.write_text(text)
    return dest


def _hog() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_once(tree: Path, *, hog: bool, timeout: float = 600.0) -> dict[str, Any]:
    """One pytest run of the regression test in `tree`; per-test outcomes and recorded values."""
    with tempfile.TemporaryDirectory() as tmp:
        junit, log = Path(tmp) / "junit.xml", Path(tmp) / "checks.jsonl"
        env = {**os.environ, "PYTHONPATH": str(tree), "GPIPE_REPRO_CHECK_LOG": str(log),
               "GPIPE_REPRO_CACHE": str(Path(tmp) / "cache")}
        hog_proc = _hog() if hog else None
        load0 = os.getloadavg()[0]
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   f"--junitxml={junit}", TEST], cwd=tree, env=env,
                                  capture_output=True, text=True, timeout=timeout)
        finally:
            if hog_proc is not None:
                hog_proc.kill()
                hog_proc.wait()
        outcomes: dict[str, str] = {}
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                state = "passed"
                for child in case:
                    if child.tag in ("failure", "error"):
                        state = "failed"
                    elif child.tag == "skipped":
                        state = "skipped"
                outcomes[case.get("name", "?")] = state
        values: dict[str, Any] = {}
        if log.exists():
            for line in log.read_text().splitlines():
                item = json.loads(line)
                values[item["check"]] = item["value"]
        return {"passed": proc.returncode == 0, "returncode": proc.returncode, "tests": outcomes,
                "values": values, "seconds": time.monotonic() - t0,
                "load_average": [load0, os.getloadavg()[0]],
                "tail": proc.stdout[-1500:] if proc.returncode else ""}


def detect(runs: int, conditions: Sequence[str] = CONDITIONS, progress: Any = print,
           after_round: Any = None) -> dict[str, Any]:
    """Run every condition `runs` times (interleaved: run i of each condition, then run i+1);
    `after_round(payload)` sees the results so far after each round."""
    by_name = {m.name: m for m in MUTATIONS}
    unknown = [c for c in conditions if c != HEALTHY and c not in by_name]
    if unknown:
        raise ValueError(f"unknown condition(s) {unknown}; choose from {list(CONDITIONS)}")
    if runs < 1:
        raise ValueError(f"--runs must be >= 1, got {runs}")
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in conditions}
    with tempfile.TemporaryDirectory(prefix="gpipe-detector-") as tmp:
        trees = {c: copy_tree(Path(tmp) / f"tree{i}", by_name.get(c)) for i, c in enumerate(conditions)}
        start = host_block(idle_fraction_before=host_idle_fraction())
        for i in range(runs):
            for c in conditions:
                r = run_once(trees[c], hog=c == HEALTHY)
                results[c].append(r)
                progress(f"run {i + 1}/{runs} {c}: {'pass' if r['passed'] else 'FAIL'} "
                         f"({r['seconds']:.0f} s, load {r['load_average'][0]:.1f})")
            if after_round is not None:
                after_round(_payload(i + 1, conditions, results, start))
    return _payload(runs, conditions, results, start)


def _payload(runs: int, conditions: Sequence[str], results: dict[str, list[dict[str, Any]]],
             start: dict[str, Any]) -> dict[str, Any]:
    """The results file: every run is a real test run on this host, so ``"method": "measured"``;
    ``"host"`` is :func:`gpipe_repro.report.provenance.host_block` taken when the detector started
    (cores, load, idle fraction, commit), plus the load averages when this payload was made."""
    return {"method": "measured", "runs": runs, "conditions": list(conditions), "results": results,
            "mutations": {m.name: {"file": m.path, "what": m.what} for m in MUTATIONS},
            "host": {**start, "load_average_end": list(os.getloadavg())}}


def summarize(payload: dict[str, Any]) -> dict[str, Any]:
    """Per condition: runs passed, per test runs passed, and the range of each recorded value."""
    out = {}
    for c, rs in payload["results"].items():
        tests = sorted({t for r in rs for t in r["tests"]})
        values = sorted({v for r in rs for v in r["values"]})
        out[c] = {"passed": sum(r["passed"] for r in rs), "runs": len(rs),
                  "tests": {t: sum(r["tests"].get(t) == "passed" for r in rs) for t in tests},
                  "values": {v: [r["values"][v] for r in rs if v in r["values"]] for v in values},
                  "load": [r["load_average"][0] for r in rs]}
    return out


def _host_note(host: dict[str, Any]) -> str:
    """", load a -> b, commit c" where the host block has them (older files do not)."""
    parts = []
    if host.get("load_average") and host.get("load_average_end"):
        parts.append(f"load {host['load_average'][0]:.1f} at the start, "
                     f"{host['load_average_end'][0]:.1f} at the end")
    if host.get("git_commit"):
        parts.append(f"commit {host['git_commit'][:10]}{' (dirty)' if host.get('git_dirty') else ''}")
    return "".join(f", {p}" for p in parts)


def _on_device(payload: dict[str, Any]) -> str:
    device = (payload.get("environment") or {}).get("device")
    return f" on {device}" if device else ""


def render(payload: dict[str, Any]) -> str:
    """The markdown page of a detector run."""
    summary = summarize(payload)
    conditions = payload["conditions"]
    n = payload["runs"]
    expected = {c: ("pass" if c == HEALTHY else "fail") for c in conditions}
    verdict = all((summary[c]["passed"] == n) if expected[c] == "pass" else (summary[c]["passed"] == 0)
                  for c in conditions)
    lines = ["# Does the CI speedup regression catch a broken pipeline and pass a healthy one?", "",
             f"Measured by `make check-regression-detector`{_on_device(payload)} ({n} run(s) per "
             "condition, "
             f"{payload['host']['usable_cores']} usable cores{_host_note(payload['host'])}). Each run "
             "is one "
             f"`pytest {TEST}` on a private copy of the tree; the conditions are interleaved.", "",
             "**Verdict: " + ("every healthy run passed and every broken run failed" if verdict
                              else "NOT clean (see below)") + ".**",
             "", markdown_table(["condition", "expected", "whole check passed", "what the breakage is",
                                 "host load (1-min avg, per run)"],
                                [[c, expected[c], f"{summary[c]['passed']}/{summary[c]['runs']}",
                                  payload["mutations"].get(c, {}).get("what", HEALTHY_WHAT),
                                  ", ".join(f"{x:.1f}" for x in summary[c]["load"])]
                                 for c in conditions]), "",
             "## Which check caught what (runs passed per test)", ""]
    tests = sorted({t for c in conditions for t in summary[c]["tests"]})
    lines += [markdown_table(["test", *conditions],
                             [[t.replace("test_", ""),
                               *[f"{summary[c]['tests'].get(t, 0)}/{summary[c]['runs']}" for c in conditions]]
                              for t in tests]), ""]
    values = sorted({v for c in conditions for v in summary[c]["values"]})

    def rng(xs: list[float]) -> str:
        if not xs:
            return "-"
        return (f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]" if len(xs) > 1
                else f"{xs[0]:.2f}")

    lines += ["## What the timeline checks measured (median [min, max] over runs)", "",
              "Thresholds (tests/repro/test_speedup_regression.py): overlap >= 0.5, replay ratio in "
              "[0.9, 1.3], recompute ratio <= 1.5, cores >= 2.", "",
              markdown_table(["value", *conditions],
                             [[v, *[rng(summary[c]["values"].get(v, [])) for c in conditions]]
                              for v in values]), ""]
    return "\n".join(lines)


app = typer.Typer(add_completion=False)


@app.command()
def main(runs: int = typer.Option(10, "--runs", min=1, help="runs per condition"),
         condition: list[str] = typer.Option(list(CONDITIONS), "--condition",
                                             help=f"a condition to run (repeat it for several): one of "
                                                  f"{', '.join(map(repr, CONDITIONS))}"),
         out: Path = typer.Option(OUT, "--out", help="where the JSON and the page are written"),
         render_only: bool = typer.Option(False, "--render-only", help="write the page again from the JSON "
                                          "already in --out (no run, no new number)")) -> None:
    """Runs the CI speedup regression on a healthy tree and on four breakages; writes the page."""
    unknown = sorted(set(condition) - set(CONDITIONS))
    if unknown:
        raise typer.BadParameter(f"unknown condition(s) {unknown}; choose from {list(CONDITIONS)}",
                                 param_hint="--condition")
    if render_only and not (out / "regression_detector.json").exists():
        raise typer.BadParameter(f"{out} holds no regression_detector.json to render (run without "
                                 "--render-only first)", param_hint="--out")
    try:     # its own earlier page is replaced, a file it did not write never; results of record clean
        check_manifest_outputs(out / "regression_detector.json", [out / "regression_detector.md"],
                               command=COMMAND, option="--out", overwrite=True, record=True,
                               legacy=lambda d: isinstance(d, dict) and {"conditions", "mutations"} <= set(d))
    except OutputRefused as e:
        sys.exit(f"{COMMAND}: {e}")
    if render_only:
        payload = read_json(out / "regression_detector.json")
        print(f"wrote {write_markdown(out / 'regression_detector.md', render(payload))}")
        return
    if usable_cores() < 2:
        sys.exit("the detector needs 2 usable cores (the distributed check runs one stage per core)")

    def write(payload: dict[str, Any]) -> Path:
        payload["summary"] = summarize(payload)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "regression_detector.json", stamp(payload, COMMAND))
        return write_markdown(out / "regression_detector.md", render(payload))

    print(f"wrote {write(detect(runs, condition, after_round=write))}")


if __name__ == "__main__":
    app()
