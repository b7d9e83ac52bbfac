"""Where the simulator's step time departs from a real run's: per stage and per action kind.

One configuration of a model the project never tuned to runs the public way (calibrate, partition,
simulate: :func:`gpipe_repro.sim.own_model.simulate_model`'s steps), then on K real stage processes
with timelines recorded. For every (stage, action kind) the table gives the seconds per step the
simulator charges and the seconds the real stages spent (median over the measured steps), and their
ratio: an action whose ratio departs from 1 is an effect the per-layer costs do not carry (its
caches, its co-running neighbour, the re-materialization as the executor runs it), and the stage
idle share shows what the schedule's waits add. Printed, and written as JSON when --out is given.

    python -m experiments.cost_model_gap --model residual --m 8 --checkpoint always
"""
from __future__ import annotations

import functools
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import typer

from gpipe_repro.engine.timeline import Timeline

MODELS = {
    "residual": ("gpipe_repro.repro.validate_unseen:residual_mlp", (1024,)),
    "conv": ("gpipe_repro.repro.validate_unseen:conv_net", (3, 16, 16)),
    "alt-residual": ("experiments.unseen_models:residual_mlp", (768,)),
    "pyramid": ("experiments.unseen_models:conv_pyramid", (3, 32, 32)),
    "transformer": ("experiments.unseen_models:transformer_blocks", (32, 256)),
}


#: The actions whose seconds come from the per-layer costs (the rest: waits, transfers, agreement).
COMPUTE = ("forward", "recompute", "backward", "backward_input", "backward_weight",
           "optimizer_step")


def per_action(timeline: Timeline) -> dict[tuple[int, str], float]:
    """Seconds per (stage, action kind) in one step's timeline."""
    out: dict[tuple[int, str], float] = defaultdict(float)
    for e in timeline.events:
        out[(e.stage, e.kind)] += e.duration
    return dict(out)


def gap(model: str, *, k: int, m: int, microbatch: int, checkpoint: str, steps: int,
        repeats: int, in_situ: bool = True) -> dict[str, Any]:
    from gpipe_repro.distributed.measure import measure_pipeline
    from gpipe_repro.models.workload import Workload
    from gpipe_repro.report.host import fast_share, usable_cores
    from gpipe_repro.sim.calibration import calibrate
    from gpipe_repro.sim.partition_choice import choose_partition
    from gpipe_repro.sim.platform import platform_for
    from gpipe_repro.sim.simulator import simulate_config
    factory, shape = MODELS[model]
    workload = Workload.create(model, factory, "image" if len(shape) == 3 else "features", shape, 10)
    n = m * microbatch
    fast_before = statistics.fmean(fast_share() for _ in range(20))
    calib = calibrate(workload, sorted({microbatch, n}), method="time", device="cpu", threads=1,
                      repeats=repeats, neighbours=max(0, min(usable_cores(), k) - 1))
    platform = platform_for("gloo-loopback")
    balance = choose_partition(calib.partition_costs(microbatch, checkpoint), k, "bottleneck",
                               calib.uncertainty_at(microbatch))
    sim = simulate_config(calib, balance, m, n, platform.link, checkpoint=checkpoint,
                          setup=platform.setup, teardown=platform.teardown)
    fast_after = statistics.fmean(fast_share() for _ in range(20))
    corrected_step = None
    if in_situ:
        from gpipe_repro.engine.schedule import make_schedule
        from gpipe_repro.sim import in_situ as situ
        from gpipe_repro.sim.simulator import simulate
        build = functools.partial(workload.build, "cpu")
        short = situ.in_situ_timelines(build, balance, workload.sample(microbatch), checkpoint=checkpoint,
                                       schedule="gpipe", loss_fn=workload.loss_fn(), threads=1)
        costs, per_stage = situ.corrected_costs(calib, balance, m, n, short, link=platform.link,
                                                checkpoint=checkpoint, schedule="gpipe",
                                                setup=platform.setup, teardown=platform.teardown)
        corrected_step = simulate(make_schedule("gpipe", k, m, checkpoint, False), costs, platform.link,
                                  n).step_time
    measured = measure_pipeline(functools.partial(workload.build, "cpu"), balance, m, workload.sample(n),
                                checkpoint=checkpoint, loss_fn=workload.loss_fn(), steps=steps, warmup=2)
    simulated = per_action(sim.timeline)
    runs = [per_action(t) for t in measured.timelines]
    keys = sorted(set(simulated) | {key for r in runs for key in r})
    rows: list[dict[str, Any]] = []
    compute: list[float] = []
    for key in keys:
        real = statistics.median(r.get(key, 0.0) for r in runs)
        model_s = simulated.get(key, 0.0)
        rows.append({"stage": key[0], "kind": key[1], "simulated_s": model_s, "measured_s": real,
                     "ratio": real / model_s if model_s > 0 else None})
        if key[1] in COMPUTE and model_s > 0:
            compute.append(real / model_s)
    return {"model": model, "K": k, "M": m, "microbatch": microbatch, "checkpoint": checkpoint,
            "balance": list(balance), "simulated_step_s": sim.step_time,
            "measured_step_s": measured.median_step_time, "measured_steps_s": list(measured.step_times),
            "error": sim.step_time and measured.median_step_time / sim.step_time - 1.0, "rows": rows,
            "in_situ": None if corrected_step is None else {
                "factors": per_stage, "simulated_step_s": corrected_step,
                "error": measured.median_step_time / corrected_step - 1.0},
            "host_fast_share": {"calibration": fast_before, "measurement": fast_after},
            "compute_ratio": {"median": statistics.median(compute), "low": min(compute),
                              "high": max(compute)} if compute else None}


def render(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} K={result['K']} M={result['M']} b={result['microbatch']} "
             f"{result['checkpoint']} balance={result['balance']}: "
             f"simulated {result['simulated_step_s'] * 1e3:.1f} ms, "
             f"measured {result['measured_step_s'] * 1e3:.1f} ms, error (sim throughput / real - 1) "
             f"{result['error']:+.1%}",
             _ratio_line(result), _in_situ_line(result),
             f"{'stage':>5} {'kind':<16} {'sim ms':>8} {'real ms':>8} {'real/sim':>8}"]
    for r in result["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"{r['stage']:>5} {r['kind']:<16} {r['simulated_s'] * 1e3:8.2f} "
                     f"{r['measured_s'] * 1e3:8.2f} {ratio:>8}")
    return "\n".join(lines)


def _in_situ_line(result: dict[str, Any]) -> str:
    situ = result.get("in_situ")
    if not situ:
        return "no in-situ correction"
    scales = "; ".join(", ".join(f"{k} {v:.2f}" for k, v in stage.items()) for stage in situ["factors"])
    return (f"corrected from an in-situ M=1 run: simulated {situ['simulated_step_s'] * 1e3:.1f} ms, "
            f"error {situ['error']:+.1%} (factors per stage: {scales})")


def _ratio_line(result: dict[str, Any]) -> str:
    """A uniform real/sim ratio over the compute actions is a host-speed shift between calibration
    and run; a spread between them is an effect the per-layer costs miss."""
    c, fast = result.get("compute_ratio"), result.get("host_fast_share") or {}
    if not c:
        return "no compute actions"
    return (f"compute actions real/sim: median {c['median']:.2f}, range {c['low']:.2f}-{c['high']:.2f}; "
            f"host fast share before calibration {fast.get('calibration', 0):.2f}, before the run "
            f"{fast.get('measurement', 0):.2f}")


app = typer.Typer(add_completion=False)


@app.command()
def cli(model: str = typer.Option("residual", help=f"one of {', '.join(MODELS)}"),
         k: int = typer.Option(2, "--k", min=1), m: int = typer.Option(8, "--m", min=1),
         microbatch: int = typer.Option(32, min=1),
         checkpoint: str = typer.Option("always", help="never, always or except_last"),
         steps: int = typer.Option(4, min=1), repeats: int = typer.Option(10, min=1),
         out: Optional[Path] = typer.Option(None, help="write the result as JSON here")) -> None:
    """Where the simulator's step time departs from a real run's, per stage and action kind."""
    if model not in MODELS:
        raise typer.BadParameter(f"{model!r}: use one of {', '.join(MODELS)}", param_hint="--model")
    if checkpoint not in ("never", "always", "except_last"):
        raise typer.BadParameter(f"{checkpoint!r}: use never, always or except_last",
                                 param_hint="--checkpoint")
    result = gap(model, k=k, m=m, microbatch=microbatch, checkpoint=checkpoint, steps=steps,
                 repeats=repeats)
    print(render(result), flush=True)
    if out is not None:
        from gpipe_repro.report.records import write_json
        write_json(out, result)


if __name__ == "__main__":
    app()
