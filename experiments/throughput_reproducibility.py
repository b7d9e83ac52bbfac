"""`make throughput-reproducibility`: do two consecutive throughput tables agree?

Runs the simulated part of `make throughput-table` twice in a row (``--no-measure``), each with a
calibration cache of its own (so each run calibrates afresh: the cache would otherwise hand the
second run the first one's costs), then compares every simulated cell and every partition
(:mod:`experiments.compare_throughput`). As two consecutive `make throughput-table` runs do, the
first keeps the cuts of the table of record where its costs cannot tell them from their best, and
the second those of the first (:mod:`gpipe_repro.repro.throughput.kept_cuts`). Target (the numbers
issue): the same partitions, and every cell within 2%. The page also gives each run's calibration
uncertainty per model (the relative half-width of its per-layer intervals,
:meth:`gpipe_repro.sim.calibration.Calibration.uncertainty_at`):
a difference the size of that uncertainty is the calibration's noise, and a target tighter than it
cannot be met by running the same calibration again.

Writes results/throughput/reproducibility.{json,md} (the results of record only from a clean commit,
checked before the runs); about 15 minutes on this project's 2-core host.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer

from experiments.compare_throughput import TARGETS, compare
from gpipe_repro.report.records import read_json
from gpipe_repro.repro.harness import check_publish, publish
from gpipe_repro.sim.partition_choice import KEEP_BAND, TIE_FLOOR

COMMAND = "throughput-reproducibility"
TARGET = TARGETS["idle"]


RECORD = Path("results") / "throughput" / "throughput_table.json"


def run_table(out: Path, cache: Path, cuts_from: Path | None) -> dict[str, Any]:
    """One simulated throughput table into `out`, calibrating into its own `cache`, keeping the cuts
    of `cuts_from` where it cannot tell them from its best (every cut afresh where None)."""
    env = {**os.environ, "GPIPE_REPRO_CACHE": str(cache), "WANDB_MODE": "offline"}
    cuts = ["--cuts-from", str(cuts_from)] if cuts_from is not None else ["--fresh-cuts"]
    cmd = [sys.executable, "-m", "experiments.throughput_table", "--no-measure", "--no-wandb",
           "--out", str(out), *cuts]
    print(f"{COMMAND}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, env=env, check=True)
    return read_json(out / "throughput_table.json")


def uncertainties(table: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per model, the calibration's relative uncertainty per micro-batch size."""
    return {model: {b: float(u) for b, u in (c.get("uncertainty") or {}).items()}
            for model, c in (table.get("calibration") or {}).items()}


def kept_count(table: dict[str, Any]) -> int:
    """How many of a table's cells kept the cut of the table before it."""
    return sum(1 for t in ("table2", "table3") for rows in (table.get(t) or {}).values()
               for r in rows if r.get("cut_kept"))


def largest_excess(table: dict[str, Any]) -> float:
    """How far above the best cut of its own costs the slowest kept cut's bottleneck lies."""
    return max((float(r.get("bottleneck_excess") or 0.0) for t in ("table2", "table3")
                for rows in (table.get(t) or {}).values() for r in rows if r.get("cut_kept")),
               default=0.0)


def verdict(result: dict[str, Any]) -> str:
    met = (result["max_abs_difference"] <= TARGET and result["partitions_agree"]
           and not result["only_in_one"])
    return "met" if met else "not met"


def page(result: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    from gpipe_repro.report.records import markdown_table
    rows = [[r["cell"], f"{r['a']:.3f}", f"{r['b']:.3f}", f"{r['relative_difference']:+.2%}",
             "yes" if r["same_partition"] else f"NO: {r['partition_a']} vs {r['partition_b']}"]
            for r in result["rows"]]
    unc = "; ".join(f"run {name}: " + ", ".join(f"{model} at {b} rows {u:.1%}"
                                                 for model, per in uncertainties(t).items()
                                                 for b, u in per.items())
                    for name, t in zip("AB", runs))
    flips = [r["cell"] for r in result["rows"] if not r["same_partition"]]
    return "\n\n".join([
        "# Reproducibility of the simulated throughput table",
        f"Two consecutive runs of `throughput-table --no-measure`, each calibrating afresh (a cache of "
        f"its own). Largest difference over {len(rows)} simulated cells: "
        f"**{result['max_abs_difference']:.2%}** (target <= {TARGET:.0%}); partitions "
        f"{'all agree' if result['partitions_agree'] else 'differ in ' + str(len(flips)) + ' cells'}: "
        f"**{verdict(result)}**.",
        f"Calibration uncertainty (relative half-width of the per-layer 95% intervals, per model): {unc}. "
        "A cell moves with the ratio of its bottleneck cell to the whole model, so differences of the "
        "size of these uncertainties are the calibration's own noise. Cuts within the larger of this "
        f"uncertainty and {TIE_FLOOR:.0%} of the best are ties. As two consecutive `make "
        "throughput-table` runs, run A keeps the cuts of the table of record and run B those of run A "
        f"while their bottleneck stays within {KEEP_BAND:g} windows of the best of its costs "
        f"({kept_count(runs[0])} and {kept_count(runs[1])} of {len(rows)} cells kept; the largest "
        f"kept bottleneck {largest_excess(runs[1]):.1%} above run B's best); elsewhere the most even "
        "cut in time among the ties is chosen (sim/partition_choice). A partition can then differ "
        "only where a kept cut left that band, or where no cut was kept and two nearly equally even "
        "cuts traded places.",
        markdown_table(["cell", "A", "B", "difference", "same partition"], rows,
                       align=["left", "right", "right", "right", "left"]),
        *([f"Cells in one run only (the verdict counts them as not reproduced): "
           f"{', '.join(result['only_in_one'])}."] if result["only_in_one"] else []),
        f"Run A: {result['provenance']['a']}. Run B: {result['provenance']['b']}."])


app = typer.Typer(add_completion=False)


@app.command()
def main() -> None:
    """Two consecutive simulated throughput tables, cell by cell and partition by partition."""
    check_publish("throughput", "reproducibility", COMMAND)
    with tempfile.TemporaryDirectory(prefix="gpipe-repro-reproducibility-") as tmp:
        first = Path(tmp) / "A"
        runs = [run_table(first, Path(tmp) / "cache-A", RECORD if RECORD.is_file() else None),
                run_table(Path(tmp) / "B", Path(tmp) / "cache-B", first / "throughput_table.json")]
    result = compare(runs[0], runs[1])
    payload = {"method": "simulated, twice, each from its own calibration", "target": TARGET,
               "verdict": verdict(result), "uncertainty": [uncertainties(t) for t in runs], **result}
    publish("throughput", "reproducibility", payload, page(result, runs), command=COMMAND)


if __name__ == "__main__":
    app()
