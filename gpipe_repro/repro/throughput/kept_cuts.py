"""The cuts of an earlier throughput table, for the new one to keep where it cannot tell them apart.

Two consecutive `make throughput-table` runs calibrate afresh, and where two cuts are within the
calibration's noise of each other no rule on the costs alone chooses the same one every time
(:mod:`gpipe_repro.sim.partition_choice`, "The kept cut"). So a run reads the cuts of the table it
replaces (the results of record for `make throughput-table`, or ``--cuts-from FILE``) and keeps
each one whose bottleneck stays within twice the window of ties of its own costs' optimum
(:data:`gpipe_repro.sim.partition_choice.KEEP_BAND`); a cut is only taken from a table of the same
model (its workload's name), micro-batch size, re-materialization and objective, and the row says
whether its cut was kept (``cut_kept``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpipe_repro.repro.throughput.settings import SweepSettings

Cuts = dict[tuple[int, int, int], list[int]]
"""(K, M, micro-batch size) -> balance."""


def cuts_of(previous: Mapping[str, Any] | None, table: str, model: str, workload: str,
            settings: SweepSettings) -> Cuts:
    """The balances `previous` (a throughput_table.json's payload) chose for `model` in `table`
    ("table2" or "table3"), where it ran the same `workload` with the same re-materialization and
    objective as `settings`; empty where it did not (or there is no earlier table)."""
    if not previous:
        return {}
    earlier = previous.get("settings") or {}
    if (earlier.get("checkpoint"), earlier.get("objective")) != (settings.checkpoint, settings.objective):
        return {}
    if ((previous.get("workloads") or {}).get(table) or {}).get(model) != workload:
        return {}
    cuts: Cuts = {}
    for row in (previous.get(table) or {}).get(model) or []:
        try:
            cuts[(int(row["K"]), int(row["M"]), int(row["microbatch"]))] = [int(n) for n in row["balance"]]
        except (KeyError, TypeError, ValueError):
            continue     # a row of an older layout: its cut is chosen afresh
    return cuts
