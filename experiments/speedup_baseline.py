"""`make baseline`: the committed speedup baseline that CI holds the pipeline to.

Two kinds of numbers, because they fail for different reasons:

- **FLOP-cost simulation** (deterministic): a CI-sized Table 2 sweep (tiny AmoebaNet-D and
  Transformer, K in {2, 4, 8}, M in {1, 4, 32}) with FLOP costs on a fixed nominal device and the
  PCIe link preset. It depends only on the models, the partitioner, the schedule and the simulator,
  so it is compared *exactly* (relative tolerance 1e-9): any drop is a real regression in one of them.
  so it is compared within a tight *two-sided* tolerance: a drop and a rise both fail (a bug that
  inflates speedups is as wrong as one that deflates them).
- **The real runtimes, judged from their timelines** (:func:`timeline_run`, :func:`local_timelines`,
  checked by tests/repro/test_speedup_regression.py with :mod:`gpipe_repro.sim.timeline_checks`): overlap,
  order, makespan against the replay of the same durations. Host load moves none of these.
- **Measured K=2 speedup** (wall clock, noisy): throughput of K=2, M=4 over K=2, M=1 on two real stage
  processes. A benchmark only (`make check-speedups`), never a test threshold.

    python -m experiments.speedup_baseline            # recompute and compare (exit 1 on a change)
    python -m experiments.speedup_baseline --write    # `make baseline`: print the diff, then write

Only ``--write`` (``make baseline``) writes the baseline; tests and plain runs never do, so a
regression can never silently become the new normal.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

BASELINE = Path(__file__).resolve().parents[1] / "results" / "baselines" / "speedups.json"
EXACT_TOLERANCE = 1e-9      # relative and two-sided, for the deterministic FLOP-cost simulation
FLOP_KS, FLOP_MS = (2, 4, 8), (1, 4, 32)
MEASURED_M = 4


def ci_workloads() -> dict[str, Any]:
    from gpipe_repro.models.workload import Workload

    return {
        "amoebanet": Workload.create("AmoebaNet-D (6, 16), 32x32 (CI)", "amoebanet-d", "image",
                                    (3, 32, 32), 10, L=6, F=16, num_classes=10, image_size=32,
                                    aux_head=False),
        "transformer": Workload.create("Transformer-12 (d 32, seq 16; CI)", "transformer-lm",
                                       "tokens", (16,), 64, L=12, d_model=32, d_ff=64, num_heads=2,
                                       vocab_size=64),
    }


def measured_workload() -> Any:
    from gpipe_repro.models.workload import Workload

    return Workload.create("Transformer-6 (d 128, seq 32; CI measured)", "transformer-lm", "tokens",
                           (32,), 128, L=6, d_model=128, d_ff=512, num_heads=4, vocab_size=128)


Perturb = Callable[[str, Any], Any]
"""(model, Calibration) -> Calibration: how a test injects a slowdown."""


def flop_calibrations() -> dict[str, Any]:
    """FLOP-cost calibrations of the CI workloads, counted afresh (never read from a cache)."""
    from gpipe_repro.sim.calibration import DEVICES, calibrate

    return {model: calibrate(workload, [4], method="flops", device_model=DEVICES["nominal"],
                             use_cache=False)
            for model, workload in ci_workloads().items()}


def flop_speedups(calibrations: dict[str, Any] | None = None,
                  perturb: Perturb | None = None) -> dict[str, float]:
    """The deterministic sweep: "model K=k M=m" -> normalized throughput (K=2, M=1 = 1)."""
    from gpipe_repro.repro.throughput import SweepSettings, simulate_rows
    from gpipe_repro.sim.platform import platform_for

    settings = SweepSettings(microbatch=(("amoebanet", 4), ("transformer", 4)), checkpoint="always",
                             recompute_ahead=False, objective="bottleneck")
    out = {}
    for model, calib in (calibrations or flop_calibrations()).items():
        if perturb is not None:
            calib = perturb(model, calib)
        for r in simulate_rows(model, calib, settings, platform_for("pcie"), FLOP_KS, FLOP_MS):
            out[f"{model} K={r.K} M={r.M}"] = r.simulated["normalized"]
    return out


def measured_configs(steps: int = 4) -> tuple[dict[str, Any], str]:
    """The two configurations of the measured K=2 speedup on two real stage processes, as the
    measurement kernel runs them (name -> one run returning seconds per sample): K=2, M=1 and
    K=2, M=MEASURED_M; their paired ratio per round is the speedup (wall clock: a benchmark number,
    see experiments/check_speedups.py; never a pytest threshold). And what was measured."""
    from gpipe_repro.engine.partition import partition
    from gpipe_repro.repro.throughput import SweepSettings, distributed_measure
    from gpipe_repro.sim.calibration import calibrate

    workload = measured_workload()
    b = 8
    measure = distributed_measure(SweepSettings(checkpoint="never", measure_steps=steps), warmup=1)
    calib = calibrate(workload, [b], method="flops", use_cache=False)
    balance = partition(calib.partition_costs(b, "never"), 2)

    def per_sample(m: int) -> Any:
        return lambda: measure(workload, balance, m, m * b, "never")["step_time_s"] / (m * b)
    config = (f"K=2 M={MEASURED_M} over K=2 M=1, {workload.name}, micro-batch {b}, "
              f"balance {balance}")
    return {"M=1": per_sample(1), f"M={MEASURED_M}": per_sample(MEASURED_M)}, config


TIMELINE_K, TIMELINE_M, TIMELINE_CHECKPOINT = 2, 4, "except_last"    # GPipe's default


def timeline_run(steps: int = 3) -> Any:
    """The distributed runtime at K=2, M=4 (GPipe's re-materialization, every micro-batch but the
    last, so both recomputes and graph-keeping forwards are recorded) on
    the measured workload: a :class:`gpipe_repro.distributed.measure.PipelineMeasurement` with
    every measured step's timeline and the cores each stage process could use."""
    import functools

    from gpipe_repro.distributed.measure import measure_pipeline
    from gpipe_repro.engine.partition import partition
    from gpipe_repro.sim.calibration import calibrate

    workload = measured_workload()
    b = 8
    calib = calibrate(workload, [b], method="flops", use_cache=False)
    balance = partition(calib.partition_costs(b, TIMELINE_CHECKPOINT), TIMELINE_K)
    return measure_pipeline(functools.partial(workload.build, "cpu"), balance, TIMELINE_M,
                            workload.sample(TIMELINE_M * b), checkpoint=TIMELINE_CHECKPOINT,
                            loss_fn=workload.loss_fn(), steps=steps, warmup=1, threads=1)


def local_timelines(steps: int = 2) -> tuple[list[Any], list[Any]]:
    """The local (one-process) runtime at K=2, M=4 on the same workload: per step, its timeline and
    the same actions timed by the thread's CPU clock."""
    import torch

    from gpipe_repro.distributed.measure import record_cpu_times
    from gpipe_repro.engine.gpipe import GPipe
    from gpipe_repro.engine.timeline import Timeline

    workload = measured_workload()
    b = 8
    torch.set_num_threads(1)
    pipe = GPipe(workload.build("cpu"), partitions=TIMELINE_K, micro_batches=TIMELINE_M,
                 checkpoint=TIMELINE_CHECKPOINT, loss_fn=workload.loss_fn(),
                 optimizer=lambda params: torch.optim.SGD(params, lr=0.01))
    pipe.record_timeline = True
    x, y = workload.sample(TIMELINE_M * b)
    walls, cpus = [], []
    for _ in range(steps + 1):
        sink: list[Any] = []
        for ex in pipe.executors:
            record_cpu_times(ex, sink)
        pipe.train_step(x, y)
        walls.append(pipe.last_timeline)
        cpus.append(Timeline(TIMELINE_K, sink, {"clock": "thread CPU time of each action"}))
    return walls[1:], cpus[1:]


def check(current: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """Every FLOP-cost speedup that differs from its baseline by more than the (two-sided) tolerance,
    and every configuration missing from either side. Empty when nothing changed."""
    failures = []
    tol = baseline["flop"].get("tolerance", EXACT_TOLERANCE)
    for key, base in baseline["flop"]["speedups"].items():
        now = current["flop"].get(key)
        if now is None:
            failures.append(f"{key}: missing from the current sweep (baseline {base:.6f})")
        elif abs(now - base) > tol * abs(base):
            word = "dropped" if now < base else "rose"
            failures.append(f"{key}: FLOP-cost speedup {word} from {base:.6f} to {now:.6f} "
                            f"({now / base - 1:+.2e}; tolerance +-{tol:.0e}): an intended change "
                            "regenerates the baseline with `make baseline`")
    for key in sorted(set(current["flop"]) - set(baseline["flop"]["speedups"])):
        failures.append(f"{key}: not in the baseline (run `make baseline` if it is new on purpose)")
    return failures


def diff(old: dict[str, float], new: dict[str, float]) -> list[str]:
    """Lines describing how `new` speedups differ from `old` (what `make baseline` prints)."""
    lines = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a is None or b is None:
            lines.append(f"  {key}: {'-' if a is None else f'{a:.6f}'} -> {'-' if b is None else f'{b:.6f}'}")
        elif abs(a - b) > EXACT_TOLERANCE * abs(a):
            lines.append(f"  {key}: {a:.6f} -> {b:.6f} ({b / a - 1:+.3%})")
    return lines


app = typer.Typer(add_completion=False)


@app.command()
def main(write: bool = typer.Option(False, "--write", help="regenerate the baseline on purpose (prints "
                                                        "the diff)")) -> None:
    """The FLOP-cost speedups against the committed baseline (exit 1 on any change), or --write."""
    from gpipe_repro.report.records import read_json, write_json

    flop = flop_speedups()
    old = read_json(BASELINE) if BASELINE.exists() else None
    if write:
        changes = diff(old["flop"]["speedups"] if old else {}, flop)
        print("FLOP-cost speedups, baseline -> now:" if changes else "FLOP-cost speedups unchanged")
        for line in changes:
            print(line)
        payload: dict[str, Any] = {"flop": {"speedups": flop, "tolerance": EXACT_TOLERANCE,
                                            "ks": FLOP_KS, "ms": FLOP_MS,
                                            "how": "FLOP costs on the 'nominal' device model, PCIe "
                                                   "link, checkpoint always, bottleneck partitions"}}
        if old and "measured" in old:
            payload["measured"] = old["measured"]     # written by `make check-speedups --write`
        write_json(BASELINE, payload)
        print(f"wrote {BASELINE}")
        return
    if old is None:
        sys.exit(f"no baseline at {BASELINE}: run `make baseline` to create one")
    failures = check({"flop": flop}, old)
    for f in failures:
        print("CHANGED", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    app()
