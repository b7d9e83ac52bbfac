"""The throughput sweep behind the paper's Tables 2 and 3: configurations -> calibrated costs ->
partitions -> simulated (and, where possible, measured) throughput -> normalized table rows.

Throughput semantics. The paper normalizes to K=2, M=1 and says the batch size "was adjusted to fit
memory if necessary"; torchgpipe grows the batch with M. We keep the **micro-batch size fixed** and
let the mini-batch grow with M (N = M x b): every configuration then runs the same per-micro-batch
kernels, so a normalized number measures pipelining (bubble, imbalance, communication,
re-materialization) and nothing else, which is what Table 2's M=1 row (about 1 for every K) and its
M=32 row (approaching K/2) describe. The other reading, a fixed mini-batch cut into M smaller
micro-batches (``policy="mini"``), is also available: it uses costs calibrated at each of those
smaller sizes, and shows how much per-sample efficiency small micro-batches lose on this device.

Re-materialization is on for every cell (``checkpoint="always"``, as the paper trains), so the K=2,
M=1 baseline pays for it too and the normalized numbers compare like with like.

Where a number comes from, per cell:

- ``simulated``: :func:`gpipe_repro.sim.simulator.simulate` with costs calibrated on this device
  (:mod:`gpipe_repro.sim.calibration`, timed at the micro-batch size the configuration uses) and the
  link of the host (gloo loopback, measured) or a preset;
- ``measured``: the distributed runtime (``gpipe_repro.distributed.measure.measure_pipeline``), K
  real processes, where K <= usable cores;
- ``flop model at paper size``: the paper's exact model, FLOP costs on a model of the paper's device
  (TPUv3 core for Table 2, P100 for Table 3) and its link: deterministic, needs no hardware.

Partitions come from :func:`gpipe_repro.engine.partition.partition` on the calibrated per-layer costs (the
seconds of forward + recompute + backward); each row records its balance and how even it is
(mean cell / slowest cell: 1 is perfect).

Modules: ``settings`` (what decides a table), ``workloads`` (its models), ``rows`` (partition, simulate,
normalize), ``measure`` (real processes), ``targets`` (the paper's numbers), ``ablations``, ``table``
(the whole sweep), ``report`` (markdown), ``outputs`` (files, figures, W&B) and ``validation``
(simulated against measured), ``schedules`` (every schedule at K=8: throughput beside
memory). The names below are the package's public surface.
"""
from __future__ import annotations

# Simulator configuration and host probing live in report/ (they are not the experiment);
# still importable from here.
from gpipe_repro.report.host import host_idle_fraction, usable_cores
from gpipe_repro.repro.throughput.ablations import (
    BubbleCurve,
    bubble_curves,
    objective_ablation,
    rematerialization_ablation,
)
from gpipe_repro.repro.throughput.measure import (
    MeasureFn,
    distributed_measure,
    measurable_k,
    measure_rows,
)
from gpipe_repro.repro.throughput.outputs import draw_gantt, log_to_wandb, run_with_progress, write_outputs
from gpipe_repro.repro.throughput.report import differences, render_markdown, render_validation_summary
from gpipe_repro.repro.throughput.rows import (
    Row,
    attach_flop_model,
    balance_efficiency,
    flop_model_rows,
    normalize,
    simulate_rows,
)
from gpipe_repro.repro.throughput.schedules import ABLATION_K, ABLATION_MS, schedule_tradeoff
from gpipe_repro.repro.throughput.settings import MODELS, POLICIES, SweepSettings
from gpipe_repro.repro.throughput.table import (
    calibration_summary,
    mini_variant,
    plan_steps,
    run_throughput_table,
)
from gpipe_repro.repro.throughput.targets import CLAIMS, check_claims, table2_paper, table2_peer, table3_paper
from gpipe_repro.repro.throughput.validation import (
    VALIDATION_CHECKPOINTS,
    VALIDATION_MS,
    VALIDATION_SCHEDULES,
    VALIDATION_TARGETS,
    validate_simulator,
    validation_ks,
)
from gpipe_repro.repro.throughput.workloads import (
    PAPER_MICROBATCH,
    PAPER_TABLE3_WORKLOADS,
    PAPER_WORKLOADS,
    SCALED_MICROBATCH,
    SCALED_TABLE3_WORKLOADS,
    SCALED_WORKLOADS,
)
from gpipe_repro.sim.platform import Platform, platform_for

__all__ = [
    "BubbleCurve", "bubble_curves", "objective_ablation", "rematerialization_ablation",
    "ABLATION_K", "ABLATION_MS", "schedule_tradeoff",
    "MeasureFn", "distributed_measure", "measurable_k", "measure_rows",
    "draw_gantt", "log_to_wandb", "run_with_progress", "write_outputs",
    "differences", "render_markdown", "render_validation_summary",
    "Row", "attach_flop_model", "balance_efficiency", "flop_model_rows", "normalize", "simulate_rows",
    "MODELS", "POLICIES", "SweepSettings",
    "calibration_summary", "mini_variant", "plan_steps", "run_throughput_table",
    "CLAIMS", "check_claims", "table2_paper", "table2_peer", "table3_paper",
    "VALIDATION_CHECKPOINTS", "VALIDATION_MS", "VALIDATION_SCHEDULES", "VALIDATION_TARGETS",
    "validate_simulator", "validation_ks",
    "PAPER_MICROBATCH", "PAPER_TABLE3_WORKLOADS", "PAPER_WORKLOADS", "SCALED_MICROBATCH",
    "SCALED_TABLE3_WORKLOADS", "SCALED_WORKLOADS",
    "Platform", "platform_for", "host_idle_fraction", "usable_cores",
]
