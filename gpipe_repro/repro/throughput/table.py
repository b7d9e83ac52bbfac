"""The whole sweep: calibrate, partition, simulate and measure Tables 2 and 3 into one payload."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from gpipe_repro.models.workload import Workload
from gpipe_repro.repro.throughput.ablations import (
    bubble_curves,
    objective_ablation,
    rematerialization_ablation,
)
from gpipe_repro.repro.throughput.kept_cuts import cuts_of
from gpipe_repro.repro.throughput.measure import (
    CELL_RULE,
    MeasureFn,
    distributed_measure,
    measurable_k,
    measure_rows,
    round_budget,
)
from gpipe_repro.repro.throughput.rows import Row, attach_flop_model, flop_model_rows, simulate_rows
from gpipe_repro.repro.throughput.schedules import ABLATION_K, ABLATION_MS, link_control, schedule_tradeoff
from gpipe_repro.repro.throughput.settings import MODELS, SweepSettings
from gpipe_repro.repro.throughput.targets import check_claims, table2_paper, table2_peer, table3_paper
from gpipe_repro.repro.throughput.workloads import (
    PAPER_MICROBATCH,
    PAPER_TABLE3_WORKLOADS,
    PAPER_WORKLOADS,
    SCALED_TABLE3_WORKLOADS,
    SCALED_WORKLOADS,
)
from gpipe_repro.sim.calibration import Calibration, calibrate
from gpipe_repro.sim.devices import DEVICES
from gpipe_repro.sim.partition_choice import choose_partition
from gpipe_repro.sim.platform import Platform, platform_for


def plan_steps(settings: SweepSettings, measuring: bool) -> int:
    """How many progress steps :func:`run_throughput_table` reports (for a progress bar)."""
    calibrations = sum(len(settings.sizes(m)) for m in MODELS) + len(MODELS)   # Table 2 + Table 3
    flop_models = 2 * len(MODELS)
    schedule_ablations = 2 * len(MODELS)    # FLOP model + calibrated, per model
    measured = (len(MODELS) * len(settings.ms) * sum(1 for k in settings.ks
                                                      if k <= measurable_k(settings))
                if measuring else 0)
    minibatch_variant = len(mini_variant(settings).sizes("transformer")) if settings.policy == "micro" else 0
    return 1 + calibrations + flop_models + schedule_ablations + minibatch_variant + measured + 1


def mini_variant(settings: SweepSettings) -> SweepSettings:
    """The other reading of Table 2: a fixed mini-batch cut into M micro-batches of N/M."""
    return replace(settings, policy="mini")


def run_throughput_table(settings: SweepSettings, progress: Callable[[str], None] | None = None,
                         measure: MeasureFn | None = None,
                         previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """Calibrate, partition, simulate and measure Tables 2 and 3; return the results payload.
    `previous`: an earlier table's payload whose cuts are kept where these costs cannot tell them
    from their best (:mod:`gpipe_repro.repro.throughput.kept_cuts`)."""
    settings.validate()
    started = time.monotonic()
    say = progress or (lambda msg: None)
    say(f"link model: {settings.link}")
    platform = platform_for(settings.link)
    workloads = PAPER_WORKLOADS if settings.paper_size else SCALED_WORKLOADS
    workloads3 = PAPER_TABLE3_WORKLOADS if settings.paper_size else SCALED_TABLE3_WORKLOADS
    calib_kw: dict[str, Any] = dict(method=settings.method, device=settings.device,
                                    threads=settings.threads, repeats=settings.repeats,
                                    neighbours=settings.busy_neighbours(),
                                    rounds=settings.calibration_rounds,
                                    max_rounds=settings.calibration_max_rounds)

    calibrations: dict[str, Calibration] = {}
    table2: dict[str, list[Row]] = {}
    for model in MODELS:
        calibrations[model] = calibrate(workloads[model], settings.sizes(model), progress=say,
                                        **calib_kw)
        table2[model] = simulate_rows(model, calibrations[model], settings, platform, settings.ks,
                                      settings.ms, base=(2, 1) if 2 in settings.ks and 1 in settings.ms
                                      else None, paper_values=table2_paper(model),
                                      peer_values=table2_peer(model),
                                      keep=cuts_of(previous, "table2", model, workloads[model].name,
                                                   settings))
        say(f"FLOP model of {PAPER_WORKLOADS[model].name} on a TPUv3 core")
        attach_flop_model(table2[model], flop_model_rows(
            model, PAPER_WORKLOADS[model], "tpu-v3-core", platform_for("tpu-ici"), settings,
            settings.ks,
            settings.ms, PAPER_MICROBATCH[model]))

    pcie = platform_for("pcie")
    table3: dict[str, list[Row]] = {}
    calibrations3: dict[str, Calibration] = {}
    m3 = 32
    for model in MODELS:
        b = settings.microbatch_size(model, m3)
        calibrations3[model] = calibrate(workloads3[model], [b], progress=say, **calib_kw)
        table3[model] = simulate_rows(model, calibrations3[model], settings, pcie, settings.ks, [m3],
                                      base=(min(settings.ks), m3), paper_values=table3_paper(model),
                                      keep=cuts_of(previous, "table3", model, workloads3[model].name,
                                                   settings))
        say(f"FLOP model of {PAPER_TABLE3_WORKLOADS[model].name} on a P100 with PCIe")
        attach_flop_model(table3[model], flop_model_rows(
            model, PAPER_TABLE3_WORKLOADS[model], "p100", pcie, settings, settings.ks, [m3],
            PAPER_MICROBATCH[model]))

    # before the measured rounds, which share what time the table has left (settings.time_limit_s)
    fixed_minibatch = None
    if settings.policy == "micro":
        mini = mini_variant(settings)
        calib_mini = calibrate(workloads["transformer"], mini.sizes("transformer"), progress=say,
                               **calib_kw)
        fixed_minibatch = [r.to_json() for r in simulate_rows(
            "transformer", calib_mini, mini, platform, settings.ks, settings.ms,
            paper_values=table2_paper("transformer"))]

    timelines: dict[str, dict[tuple[int, int], Any]] = {}
    measure = measure if measure is not None else (distributed_measure(settings)
                                                   if settings.measure else None)
    if measure is not None:
        for i, model in enumerate(MODELS):
            rule = round_budget(CELL_RULE, settings.time_limit_s, time.monotonic() - started,
                                len(MODELS) - i)
            timelines[model] = measure_rows(table2[model], workloads[model], measure,
                                            measurable_k(settings), settings.checkpoint, say,
                                            base=(2, 1), rule=rule)

    curves = bubble_curves(calibrations["transformer"], settings, platform, "transformer",
                           ks=settings.ks)
    gantt_k = 4 if 4 in settings.ks else max(settings.ks)
    gantt_balance = choose_partition(calibrations["transformer"].partition_costs(
        settings.microbatch_size("transformer", 8), settings.checkpoint), gantt_k,
        settings.objective) \
        if settings.microbatch_size("transformer", 8) in calibrations["transformer"].costs else None
    gantt = None
    if gantt_balance is not None:
        b = settings.microbatch_size("transformer", 8)
        sim = platform.simulate(calibrations["transformer"], gantt_balance, 8, 8 * b, settings)
        gantt = {"caption": f"Simulated transformer step, K={gantt_k}, M=8, balance {gantt_balance}, "
                            f"checkpoint {settings.checkpoint}.",
                 "timeline": sim.timeline.to_json()}
    objectives = {model: objective_ablation(calibrations[model], settings, platform, model,
                                            k=max(settings.ks), m=max(settings.ms))
                  for model in MODELS}
    ablation = {model: rematerialization_ablation(calibrations[model], settings, platform, model,
                                                  k=max(settings.ks), m=max(settings.ms))
                for model in MODELS}
    schedules = {model: schedule_ablation_rows(model, calibrations[model], settings, platform,
                                               workloads[model], say)
                 for model in MODELS}
    return {
        "settings": asdict(settings),
        "link": platform.to_json(),
        "workloads": {"table2": {m: workloads[m].name for m in MODELS},
                      "table3": {m: workloads3[m].name for m in MODELS},
                      "flop_model_table2": {m: PAPER_WORKLOADS[m].name for m in MODELS},
                      "flop_model_table3": {m: PAPER_TABLE3_WORKLOADS[m].name for m in MODELS}},
        "calibration": {m: calibration_summary(c) for m, c in calibrations.items()},
        "table2": {m: [r.to_json() for r in rows] for m, rows in table2.items()},
        "table3": {m: [r.to_json() for r in rows] for m, rows in table3.items()},
        "table2_fixed_minibatch": fixed_minibatch,
        "bubble_curves": [asdict(c) for c in curves],
        "ablation": ablation,
        "schedule_ablation": schedules,
        "schedule_link_control": {
            "method": "simulated", "on": f"{PAPER_WORKLOADS['amoebanet'].name} on the FLOP model (TPUv3 "
            f"core), K={ABLATION_K}, M=32, checkpoint never; the TPU link and a free one",
            "samples_per_s": link_control()},
        "objectives": objectives,
        "claims": check_claims(table2),
        "timelines": {m: {f"K{k}_M{mm}": t.to_json() for (k, mm), t in tl.items()}
                      for m, tl in timelines.items()},
        "gantt": gantt,
    }


def schedule_ablation_rows(model: str, calib: Calibration, settings: SweepSettings,
                           platform: Platform, workload: Workload,
                           say: Callable[[str], None] = lambda msg: None) -> list[dict[str, Any]]:
    """The schedule ablation at K=8 for one model: the paper-size FLOP model (as Table 2's FLOP
    column: TPUv3-core rate, TPU interconnect), then this host's calibrated costs on the scaled model
    (at the sweep's micro-batch size for each M, where calibrated)."""
    say(f"schedule ablation of {PAPER_WORKLOADS[model].name}: FLOP model, K={ABLATION_K}")
    b = PAPER_MICROBATCH[model]
    flops = calibrate(PAPER_WORKLOADS[model], [b], method="flops", device_model=DEVICES["tpu-v3-core"])
    rows = schedule_tradeoff(flops, PAPER_WORKLOADS[model], settings, platform_for("tpu-ici"),
                             microbatch=b, costs="flop model")
    say(f"schedule ablation of {workload.name}: calibrated costs, K={ABLATION_K}")
    for m in ABLATION_MS:
        size = settings.microbatch_size(model, m)
        if size in calib.costs:
            rows += schedule_tradeoff(calib, workload, settings, platform, microbatch=size,
                                      costs="calibrated", ms=[m])
    return rows


def calibration_summary(calib: Calibration) -> dict[str, Any]:
    """Per micro-batch size: seconds per sample of one full forward + backward, and the groups."""
    per_sample = {str(size): sum(c.forward + c.backward for c in costs) / size
                  for size, costs in sorted(calib.costs.items())}
    return {"device": calib.device, "method": calib.method, "layers": calib.num_layers,
            "distinct_layers": len(set(calib.groups)), "optimizer_call_s": calib.optimizer_call,
            "per_sample_s": per_sample,
            "uncertainty": {str(size): u for size, u in sorted(calib.uncertainty.items())}}


