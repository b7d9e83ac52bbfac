"""`make replicas-plan-table`: the K x R x M choice for Transformer-L and AmoebaNet-D on 8, 64, 512 and
2048 devices (simulated), with the runner-up, in results/replicas/plan.{json,md}.

Each cell is :func:`gpipe_repro.memory.replicas_plan.plan_replicas` on devices of ``--memory`` GiB at
``--tflops`` TFLOP/s, 8 per host (NVLink inside, InfiniBand EDR between hosts:
:mod:`gpipe_repro.sim.data_parallel`), with the replica mini-batch fixed (weak scaling). The command
line is `gpipe-repro replicas-plan-table`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpipe_repro.memory.planner import GiB, MemoryPlanner
from gpipe_repro.memory.profile import rmsprop_foreach
from gpipe_repro.memory.replicas_plan import plan_replicas
from gpipe_repro.memory.workloads import workload
from gpipe_repro.report.output_guard import check_manifest_outputs
from gpipe_repro.report.records import markdown_table, results_dir, simulated, write_json, write_markdown
from gpipe_repro.sim.links import get_link

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "Transformer-L (L=48)": ("transformer-lm", {"L": 48}),
    "AmoebaNet-D (18, 256)": ("amoebanet-d", {"L": 18, "F": 256}),
}
DEVICES = (8, 64, 512, 2048)


COMMAND = "replicas-plan-table"


def main(*, memory: float = 16.0, tflops: float = 100.0, ms: Sequence[int] = (4, 8, 16, 32),
         devices: Sequence[int] = DEVICES, overwrite: bool = False, record: bool = False) -> None:
    """Plan every (model, N), print and record the table in results/replicas/ (`memory` GiB, `tflops`
    TFLOP/s per device, `ms` the M candidates). Its own earlier plan.{json,md} there are replaced
    only with `overwrite`, the results of record only with `record` (what the make target passes),
    a file it did not write never (checked before any work)."""
    out = results_dir("replicas")
    check_manifest_outputs(out / "plan.json", [out / "plan.md"], command=COMMAND,
                           option="results/replicas", overwrite=overwrite, record=record,
                           legacy=lambda d: isinstance(d, dict) and d.get("experiment") == "K x R x M plans")
    rows, records = [], []
    for label, (family, options) in MODELS.items():
        work = workload(family, None, **options)
        planner = MemoryPlanner(*work.planner_inputs(),
                                optimizer=rmsprop_foreach, optimizer_foreach=True)
        for n in devices:
            cands = plan_replicas(planner, n, memory * GiB, get_link("nvlink"), tflops * 1e12,
                                  micro_batches=list(ms), checkpoints=("except_last",))
            fit = [c for c in cands if c.fits]
            best, second = (fit + [None, None])[:2]
            cell = (lambda c: "-" if c is None else
                    f"K={c.partitions} x R={c.replicas}, M={c.pipeline.micro_batches}")
            rows.append([label, n, cell(best), None if best is None else best.throughput,
                         cell(second), "nothing fits" if best is None else best.why()])
            records.append({"model": work.describe(), "devices": n,
                            "choice": None if best is None else best.to_json(),
                            "throughput": simulated(None if best is None else best.throughput,
                                                    unit="samples/s"),
                            "candidates": [c.to_json() for c in cands]})
            print(f"{label}, {n} devices: {cell(best)}", flush=True)
    table = markdown_table(["model", "devices", "choice", "samples/s (simulated)", "runner-up", "why"],
                           rows)
    config = {"memory": memory, "tflops": tflops, "ms": list(ms), "devices": list(devices)}
    write_json(out / "plan.json", {"experiment": "K x R x M plans", "config": config,
                                   "method": "simulated", "rows": records, "written_by": COMMAND})
    write_markdown(out / "plan.md", "# K x R x M for N devices (simulated)\n\n"
                   f"{memory:g} GiB and {tflops:g} TFLOP/s per device, 8 per host; replica "
                   "mini-batch fixed (the model family's default batch).\n\n" + table)
    print(table)
