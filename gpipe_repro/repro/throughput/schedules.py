"""The schedule ablation of ``make throughput-table``: every schedule at the paper's K=8, throughput
beside peak memory per device.

GPipe's fill-drain keeps all M micro-batches' activations; 1F1B keeps at most K - s on stage s at the
same bubble; interleaved 1F1B shrinks the bubble by v=2 with two cells per device; ZB-H1 fills the
bubble with weight gradients and keeps their graphs until then. The paper could not show this
trade-off; this table does, twice, all simulated:

- ``flop model``: the paper's exact model (Table 2's), FLOP costs on a TPUv3-core model over the
  TPU interconnect (deterministic, no hardware), exactly as the ``flop model`` column of Table 2;
- ``calibrated``: the scaled model this host runs, per-layer costs calibrated on this device and the
  host's link, as the table's simulated cells.

Throughput comes from :func:`gpipe_repro.sim.simulator.simulate` over those costs on a cut of the
calibrated costs (the sweep's objective; 2K cells for interleaved); memory from the memory planner
replaying each schedule's own actions on the same cut (:func:`gpipe_repro.memory.schedule_ablation`,
which this module drives with the calibrated costs).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpipe_repro.engine.microbatch import split_sizes
from gpipe_repro.engine.schedule import Schedule
from gpipe_repro.memory.planner import MemoryPlanner
from gpipe_repro.memory.profile import rmsprop_foreach
from gpipe_repro.memory.schedule_ablation import schedule_ablation
from gpipe_repro.models.workload import Workload
from gpipe_repro.report.records import markdown_table
from gpipe_repro.repro.throughput.settings import SweepSettings
from gpipe_repro.sim.calibration import Calibration
from gpipe_repro.sim.partition_choice import choose_cut
from gpipe_repro.sim.platform import Platform
from gpipe_repro.sim.simulator import Simulation, simulate, stage_costs

ABLATION_K = 8            # the paper's largest pipeline in Table 2
ABLATION_MS = (8, 32)     # M = K (fill-drain's worst case) and Table 2's largest M


def schedule_tradeoff(calib: Calibration, workload: Workload, settings: SweepSettings,
                      platform: Platform, *, microbatch: int, costs: str, k: int = ABLATION_K,
                      ms: Sequence[int] = ABLATION_MS) -> list[dict[str, Any]]:
    """One row per (M, schedule) at K=`k`: simulated samples/s, bubble and each device's peak and
    peak activation memory, on the cut `settings.objective` gives `calib`'s costs at `microbatch`.

    `workload` is the model `calib` was calibrated on (the planner builds it on the meta device with
    mini-batch M x `microbatch`); `costs` labels the rows ("flop model" or "calibrated")."""
    if k < 1 or not ms or min(ms) < 1:
        raise ValueError(f"the schedule ablation needs K >= 1 and M >= 1, got K={k}, M={list(ms)}")
    if microbatch not in calib.costs:
        raise ValueError(f"the calibration has no costs at micro-batch size {microbatch} (it has "
                         f"{sorted(calib.costs)}): calibrate that size first")
    def cut(sched: Schedule) -> list[int]:
        return choose_cut(calib, microbatch, settings.checkpoint, sched, settings.objective)

    rows: list[dict[str, Any]] = []
    for m in ms:
        n = m * microbatch
        planner = MemoryPlanner(*workload.with_batch(n).planner_inputs(), optimizer=rmsprop_foreach,
                                optimizer_foreach=True)
        if planner.num_layers != calib.num_layers:
            raise ValueError(f"the planner sees {planner.num_layers} layers of {workload.name} but "
                             f"the calibration {calib.num_layers}: calibrate this workload")

        def step(sched: Schedule, balance: Sequence[int], m: int = m, n: int = n) -> Simulation:
            return simulate(sched, stage_costs(calib, balance, split_sizes(n, m), platform.setup,
                                               platform.teardown), platform.link, n)

        for row in schedule_ablation(planner, devices=k, micro_batches=m, checkpoint=settings.checkpoint,
                                     cut=cut, simulate_step=step):
            rows.append({"costs": costs, "workload": workload.name, "microbatch": microbatch,
                         "batch": n, "link": platform.link.name, **row})
    return rows


def link_control(model: str = "amoebanet", *, m: int = 32,
                 checkpoint: str = "never") -> dict[str, dict[str, float]]:
    """The schedule ablation's FLOP-model row at K=8 twice: on the TPU link and on a free link (no
    latency, infinite bandwidth), same costs and cut. Shows how much of a schedule's simulated
    throughput the link costs it (why `gpipe` can beat `1f1b` on AmoebaNet-D's large activations).
    Returns {link name: {schedule: samples/s}}; all simulated."""
    import dataclasses

    from gpipe_repro.repro.throughput.workloads import PAPER_MICROBATCH, PAPER_WORKLOADS
    from gpipe_repro.sim.calibration import calibrate
    from gpipe_repro.sim.devices import DEVICES
    from gpipe_repro.sim.links import LinkModel
    from gpipe_repro.sim.platform import platform_for

    settings = dataclasses.replace(SweepSettings(), checkpoint=checkpoint)
    b = PAPER_MICROBATCH[model]
    flops = calibrate(PAPER_WORKLOADS[model], [b], method="flops", device_model=DEVICES["tpu-v3-core"])
    real = platform_for("tpu-ici")
    free = Platform(LinkModel("free", 0.0, float("inf")), real.setup, real.teardown)
    return {plat.link.name: {r["schedule"]: float(r["throughput"])
                             for r in schedule_tradeoff(flops, PAPER_WORKLOADS[model], settings, plat,
                                                        microbatch=b, costs="flop model", ms=[m])}
            for plat in (real, free)}


def render_schedule_ablation(ablation: dict[str, list[dict[str, Any]]],
                             control: dict[str, dict[str, float]] | None = None) -> list[str]:
    """The schedule ablation's section (markdown lines; none if there is no ablation): per model,
    cost model and M, every schedule's simulated samples/s and bubble beside the largest device's
    peak memory and peak activation memory; with `control` (:func:`link_control`'s result), what the
    link costs each schedule, and which schedules GPipe beats only because of it."""
    rows = [r for items in ablation.values() for r in items]
    if not rows:
        return []
    gib = float(1 << 30)
    body = []
    for r in rows:
        if "note" in r:
            body.append([r["workload"], r["costs"], str(r["micro_batches"]), r["schedule"],
                         "-", "-", "-", "-", r["note"]])
            continue
        body.append([r["workload"], r["costs"], str(r["micro_batches"]), r["schedule"],
                     f"{r['throughput']:.1f}", f"{r['bubble']:.3f}",
                     f"{r['max_peak_bytes'] / gib:.3g}", f"{r['max_activation_peak_bytes'] / gib:.3g}",
                     "2 cells per device, walked together"
                     if r["cells"] != r["devices"] else ""])
    k = rows[0]["devices"]
    return [f"## Which schedule: throughput beside memory at K={k} (simulated)", "",
            markdown_table(["model", "costs", "M", "schedule", "samples/s", "bubble",
                            "largest device peak GiB", "its activations GiB", "note"], body,
                           align=["left", "left", "right", "left", "right", "right", "right",
                                  "right", "left"]), "",
            "Every number is simulated: the step by the simulator executing each schedule's own "
            "actions, the memory by the memory planner replaying them, on the same cut. `flop model`: "
            "the paper's model, FLOP costs on a TPUv3-core model and the TPU interconnect; "
            "`calibrated`: the scaled model, per-layer costs measured on this host. `gpipe` keeps "
            "every micro-batch's activations; `1f1b` at most K - s on stage s with the same bubble; "
            "`interleaved` (v=2 cells per device, Narayanan et al., SC'21) divides the bubble by v; "
            "`zb-h1` (Qi et al., ICLR 2024) fills it with weight gradients, keeping their graphs "
            "until then. Compare samples/s at equal or lower memory.", ""] + _link_lines(control)


def _link_lines(control: dict[str, dict[str, float]] | None) -> list[str]:
    """What the link costs each schedule (the control's two links), in words the numbers decide."""
    if not control or "free" not in control or len(control) != 2:
        return []
    free = control["free"]
    link, real = next((name, row) for name, row in control.items() if name != "free")
    shown = [s for s in ("gpipe", "1f1b", "zb-h1") if s in real and s in free]
    numbers = (f"AmoebaNet-D on the FLOP model, same costs and cut, K={ABLATION_K}, M=32, checkpoint "
               f"never (simulated; `python -m experiments.schedule_link_control`): on the {link} link "
               + ", ".join(f"{s} {real[s]:.0f}" for s in shown) + " samples/s; on a free link (no "
               "latency, infinite bandwidth) " + ", ".join(f"{s} {free[s]:.0f}" for s in shown) + ".")
    by_link = [s for s in shown if s != "gpipe" and real["gpipe"] > real[s] and free["gpipe"] <= free[s]]
    if not by_link:
        return [f"The link's cost: {numbers}", ""]
    names = " and ".join(f"`{s}`" for s in by_link)
    return [f"Where `gpipe` beats {names}, the link does, not the schedule: {numbers} GPipe's "
            "back-to-back forwards and backwards hide each transfer behind the next micro-batch's "
            "compute; 1F1B's steady state alternates a forward and a backward that each wait for a "
            "neighbour, so a transfer sits on its critical path once per micro-batch. Where "
            "`zb-h1` stays ahead, its weight gradients fill those waits.", ""]


__all__ = ["ABLATION_K", "ABLATION_MS", "schedule_tradeoff", "link_control", "render_schedule_ablation"]
