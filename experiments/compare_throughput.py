"""Do two throughput tables agree? Every simulated cell and every partition of two
``throughput_table.json`` files, side by side (two consecutive `make throughput-table` runs
must agree within 2% on an idle host and within 5% with one busy process, with the same partitions).

    python -m experiments.compare_throughput RUN_A/throughput_table.json RUN_B/throughput_table.json

The page of record comes from `make throughput-reproducibility`
(:mod:`experiments.throughput_reproducibility`), which runs the two tables and compares them here.

Measured cells are not compared: they are wall-clock numbers and carry their own host conditions.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from gpipe_repro.report.records import markdown_table, read_json, write_markdown

TARGETS = {"idle": 0.02, "busy": 0.05}


def cells(payload: dict[str, Any]) -> dict[str, tuple[float, list[int]]]:
    """"table model K=k M=m" -> (simulated normalized throughput, balance)."""
    out = {}
    for table in ("table2", "table3"):
        for model, rows in (payload.get(table) or {}).items():
            for r in rows:
                out[f"{table} {model} K={r['K']} M={r['M']}"] = (r["simulated"]["normalized"],
                                                                 list(r["balance"]))
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per cell: both values, relative difference, whether the partitions agree."""
    ca, cb = cells(a), cells(b)
    common = sorted(set(ca) & set(cb))
    if not common:
        raise ValueError("the two tables have no cell in common: compare two runs of the same sweep")
    rows: list[dict[str, Any]] = [{"cell": key, "a": ca[key][0], "b": cb[key][0],
             "relative_difference": cb[key][0] / ca[key][0] - 1.0,
             "same_partition": ca[key][1] == cb[key][1], "partition_a": ca[key][1],
             "partition_b": cb[key][1]} for key in common]
    worst = max(abs(float(r["relative_difference"])) for r in rows)
    return {"rows": rows, "max_abs_difference": worst,
            "partitions_agree": all(r["same_partition"] for r in rows),
            "only_in_one": sorted(set(ca) ^ set(cb)),
            "provenance": {"a": provenance(a), "b": provenance(b)}}


def provenance(table: dict[str, Any]) -> str:
    """Where a table's simulated cells come from: the host, the commit, and per model how its costs
    were obtained (timed or counted, on which device); "not recorded" for an older table."""
    env = table.get("environment") or {}
    costs = "; ".join(f"{model} {c.get('method', '?')} on {c.get('device', '?')}"
                      for model, c in sorted((table.get("calibration") or {}).items()))
    host = env.get("device") or env.get("cpu")
    commit = str(env.get("git_commit") or "")[:7]
    parts = ([f"host {host}"] if host else []) + ([f"commit {commit}"] if commit else []) \
        + ([f"costs: {costs}"] if costs else [])
    return ", ".join(parts) or "not recorded"


def render(result: dict[str, Any], a_path: str, b_path: str, condition: str) -> str:
    """The markdown page of one comparison."""
    target = TARGETS[condition]
    met = result["max_abs_difference"] <= target and result["partitions_agree"]
    where = "an idle host" if condition == "idle" else "a host with one busy process"
    head = (f"# Reproducibility of the simulated throughput table ({condition} host)\n\n"
            f"Run A: `{a_path}`; run B: `{b_path}`. Largest difference over "
            f"{len(result['rows'])} simulated cells: {result['max_abs_difference']:.2%} (target "
            f"<= {target:.0%} on {where}); "
            f"partitions {'all agree' if result['partitions_agree'] else 'DIFFER'}: "
            f"**{'met' if met else 'NOT met'}**.\n\n")
    prov = result.get("provenance")
    if prov:
        head += (f"Every cell is simulated (the pipeline simulator over each run's own calibrated "
                 f"costs). Run A: {prov['a']}. Run B: {prov['b']}.\n\n")
    body = [[r["cell"], f"{r['a']:.3f}", f"{r['b']:.3f}", f"{r['relative_difference']:+.2%}",
             "yes" if r["same_partition"] else f"NO: {r['partition_a']} vs {r['partition_b']}"]
            for r in result["rows"]]
    return head + markdown_table(["cell", "A", "B", "difference", "same partition"], body,
                                 align=["left", "right", "right", "right", "left"])


app = typer.Typer(add_completion=False)


@app.command()
def main(a: Path = typer.Argument(..., help="a throughput_table.json (throughput-table --out DIR)"),
         b: Path = typer.Argument(..., help="the throughput_table.json to compare it with"),
         condition: str = typer.Option("idle", "--condition", help="the host state both runs were taken "
                                       f"in, which decides the target: {' | '.join(TARGETS)}"),
         out: Path | None = typer.Option(None, "--out", help="write the markdown here (default: print it)"),
         ) -> None:
    """Compares two throughput tables cell by cell and partition by partition."""
    if condition not in TARGETS:
        raise typer.BadParameter(f"must be one of {', '.join(TARGETS)}, got {condition!r}",
                                 param_hint="--condition")
    for p in (a, b):
        if not p.exists():
            raise typer.BadParameter(f"{p} does not exist (a throughput_table.json written by "
                                     "`gpipe-repro throughput-table --out DIR`)")
    if out is not None and out.exists() and out.resolve() in {a.resolve(), b.resolve()}:
        raise typer.BadParameter("would overwrite one of the tables being compared", param_hint="--out")
    text = render(compare(read_json(a), read_json(b)), str(a), str(b), condition)
    if out is not None:
        print(f"wrote {write_markdown(out, text)}")
    else:
        print(text)


if __name__ == "__main__":
    app()
