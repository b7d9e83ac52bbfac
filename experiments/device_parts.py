"""The parts of `make device-results`, each run as its own child process by
:mod:`experiments.device_results` (``python -m experiments.device_parts PART --work DIR``).

Each part writes ``DIR/PART/result.json`` (its figures, settings and the environment) and whatever
files its experiment writes beside it. ``--tiny``: toy sizes on the CPU, K = 2 and R = 2 only, a few
seconds each (what the test suite runs); otherwise the lent GPU host's sizes.

- ``host-speed``: the host's speed stability, with the probe every measurement of this project reads
  once per round (:func:`gpipe_repro.report.host.fast_share`), read back to back for a few seconds;
- ``gpu-check``: :mod:`gpipe_repro.repro.gpu_check` (engine equality and the cost model on the GPU;
  the overhead and memory parts do not fit the 8-minute whole), ``--tiny``: its CPU preset;
- ``validate-sim-kK``: the simulator against K real stage processes on the host's CPU cores
  (:mod:`gpipe_repro.repro.validate_simulator`, one model, two M); ``--tiny``: a toy residual MLP
  through the public path (:func:`gpipe_repro.sim.own_model.simulate_model`);
- ``bench-schedules-kK``: every single-cell schedule of ours at K stage processes against plain
  PyTorch on one, in alternating rounds (:func:`gpipe_repro.repro.harness.rounds_in_processes`);
- ``bench-replicas``: K=1 x R data parallel against one process, R = 2 and 4 (``--tiny``: 2);
- ``bench-compile``: torch.compile against eager, the launch-bound M=32 case and ``sync=False``
  (:mod:`experiments.bench_compile`) on the GPU.
"""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from gpipe_repro.report.records import write_json


def host_speed(tiny: bool) -> dict[str, Any]:
    from gpipe_repro.report.host import fast_share, host_idle_fraction, speed_probe, usable_cores
    seconds = 1.0 if tiny else 6.0
    readings, t0 = [], time.monotonic()
    while time.monotonic() - t0 < seconds:
        readings.append(fast_share())
    mean = sum(readings) / len(readings)
    return {"fast_share": {"mean": mean, "min": min(readings), "max": max(readings),
                           "readings": len(readings), "seconds": seconds, "values": readings},
            "speed_probe_loops_per_s": speed_probe(), "idle_fraction": host_idle_fraction(0.5),
            "usable_cores": usable_cores(), "load_average": list(os.getloadavg())}


def gpu_check(tiny: bool, work: Path) -> dict[str, Any]:
    from gpipe_repro.repro.gpu_check import run_gpu_check
    from gpipe_repro.repro.gpu_check.report import write_report
    from gpipe_repro.repro.gpu_check.settings import GpuCheckSettings
    settings = (GpuCheckSettings.tiny_preset("cpu", parts=("engine", "costs")) if tiny
                else GpuCheckSettings.full("cuda:0", parts=("engine", "costs")))
    payload = run_gpu_check(settings, progress=lambda msg: print(msg, flush=True))
    files = write_report(payload, work / "gpu-check-report")
    return {"settings": settings.to_json(), "files": [f.name for f in files],
            "seconds": payload.get("seconds"), "not_run": ["overhead", "memory"]}


def validate_sim(tiny: bool, work: Path, k: int) -> dict[str, Any]:
    if tiny:
        from gpipe_repro.models.workload import Workload
        from gpipe_repro.repro.throughput.simulator_error import error_figure
        from gpipe_repro.sim.own_model import simulate_model
        workload = Workload.create("residual MLP 2x32 (tiny)",
                                   "gpipe_repro.repro.validate_unseen:residual_mlp", "features", (32,), 10,
                                   width=32, blocks=2)
        rows = []
        for m in (2,):
            r = simulate_model(workload, k=k, m=m, microbatch=16, checkpoint="never", validate=True,
                               steps=2, repeats=3).to_json()
            steps = r.get("measured_step_times_s") or [r["measured_step_time_s"]]
            rows.append({"K": k, "M": m, "measured_step_s": r["measured_step_time_s"],
                         "simulated_step_s": r["step_time_s"],
                         "error": error_figure(steps, r["step_time_s"]).to_json()})
        return {"path": "simulate_model (tiny)", "rows": rows}
    from gpipe_repro.repro.validate_simulator import main as validate_main
    out = work / f"validate-sim-k{k}-pages"
    # One round (each round calibrates again): the lent host's 8 minutes hold no more.
    validate_main(ks=[k], models=["transformer"], ms=[2, 8], schedules=["gpipe"], steps=3, rounds=1,
                  out=out)
    from gpipe_repro.report.records import read_json
    manifest = read_json(out / "validation.json")
    return {"path": "validate_simulator", "summary": manifest.get("summary")}


class _OursK:
    """GPipe on K stage processes (distributed runtime), the synthetic MLP cut into K equal cells."""

    def __init__(self, width: int, blocks: int, k: int, m: int, schedule: str) -> None:
        from torch import nn

        from gpipe_repro import GPipe
        from gpipe_repro.models.mlp import synthetic_mlp
        from gpipe_repro.repro.harness import sgd
        self.pipe = GPipe(synthetic_mlp(width, blocks), partitions=k, micro_batches=m,
                          balance=[blocks // k] * k, checkpoint="never", schedule=schedule,
                          loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, runtime="distributed")
        self.pipe.make_schedule()

    def step(self, x: Any, y: Any) -> None:
        self.pipe.train_step(x, y)


def _schedules_in_process(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs in each of the K stage processes: the rounds of every (M, schedule)."""
    from gpipe_repro.distributed.process_group import init_distributed
    from gpipe_repro.engine.schedule import SCHEDULES, cells_per_process
    from gpipe_repro.report.measurement import Comparison, StopRule
    from gpipe_repro.repro.harness import PlainK1, batch, rounds_in_processes
    rank = init_distributed().rank
    w, blocks, k = cfg["width"], cfg["blocks"], cfg["k"]
    x, y = batch(w, cfg["rows"])
    out: dict[str, Any] = {"measurements": {}, "refused": {}}
    for m in cfg["ms"]:
        items: dict[str, Any] = {"k1_full": PlainK1(w, blocks) if rank == 0 else None}
        for name in SCHEDULES:
            if cells_per_process(name) != 1:
                continue
            try:
                items[f"ours:{name}"] = _OursK(w, blocks, k, m, name)
            except ValueError as e:
                out["refused"][f"{m}/ours:{name}"] = str(e).splitlines()[0][:200]
        comps = [Comparison(f"speedup {n}", "k1_full", n) for n in items if n != "k1_full"]
        out["measurements"][str(m)] = rounds_in_processes(items, comps, StopRule(**cfg["rule"]), x, y,
                                                          label=f"schedules K={k} M={m}")
    return out


def bench_schedules(tiny: bool, k: int) -> dict[str, Any]:
    from gpipe_repro.distributed import launch_local
    rule = ({"min_rounds": 2, "max_rounds": 2, "budget_s": 5.0, "tolerance": 0.05} if tiny
            else {"min_rounds": 3, "max_rounds": 20, "budget_s": 9.0, "tolerance": 0.03})
    cfg = {"k": k, "width": 64 if tiny else 1024, "blocks": 2 * k if tiny else 4 * k,
           "rows": 64 if tiny else 1024, "ms": [4] if tiny else [4, 8], "rule": rule}
    result = launch_local(_schedules_in_process, k, cfg, timeout=120)[0]
    return {"settings": cfg, **result, "note": "torch.distributed.pipelining's schedules are compared "
            "at K=2 by make bench-schedules; here ours alone at K stage processes"}


def bench_replicas(tiny: bool) -> dict[str, Any]:
    import statistics

    from gpipe_repro.distributed import launch_local
    from gpipe_repro.report.measurement import Comparison, StopRule, measure
    from gpipe_repro.repro.bench_replicas import train_steps
    width, depth, n = (64, 2, 64) if tiny else (1024, 4, 1024)
    steps, warmup = (2, 1) if tiny else (4, 2)
    rule = (StopRule(min_rounds=2, max_rounds=2, budget_s=5.0, tolerance=0.05) if tiny
            else StopRule(min_rounds=3, max_rounds=15, budget_s=12.0, tolerance=0.03))

    def job(r: int) -> float:
        runs = launch_local(train_steps, r, 1, r, width, depth, n, 1, steps, warmup, timeout=120)
        return statistics.median(runs[0]["times"])
    out = {}
    for r in ((2,) if tiny else (2, 4)):
        configs: dict[str, Callable[[], float]] = {"one": lambda: job(1), f"r{r}": functools.partial(job, r)}
        result = measure(configs,
                         [Comparison(f"K=1 x R={r} speedup over one process (ideal {r}x)", "one", f"r{r}",
                                     tolerance=0.03)], rule, label=f"replicas R={r}")
        out[f"R={r}"] = result.to_json()
    return {"settings": {"width": width, "depth": depth, "global_batch": n, "steps": steps}, "results": out}


def bench_compile(tiny: bool, work: Path) -> dict[str, Any]:
    """torch.compile against eager, the launch-bound M=32 case and sync=False on the GPU
    (experiments/bench_compile.py; its own page in this part's folder)."""
    import torch

    from experiments.bench_compile import run as run_bench_compile
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    payload = run_bench_compile(device, 5.0 if tiny else 15.0, work, tiny, max_rounds=3 if tiny else 40)
    return {"device": device, "groups": sorted(payload.get("groups", {}))}


def run(part: str, work: Path, tiny: bool) -> dict[str, Any]:
    if part == "host-speed":
        return host_speed(tiny)
    if part == "gpu-check":
        return gpu_check(tiny, work)
    if part.startswith("validate-sim-k"):
        return validate_sim(tiny, work, int(part.removeprefix("validate-sim-k")))
    if part.startswith("bench-schedules-k"):
        return bench_schedules(tiny, int(part.removeprefix("bench-schedules-k")))
    if part == "bench-replicas":
        return bench_replicas(tiny)
    if part == "bench-compile":
        return bench_compile(tiny, work)
    raise ValueError(f"unknown part {part!r}")




def method(part: str) -> str:
    """How a part's figures were made: measured on this host, and for validate-sim the simulator's
    prediction of the same configurations beside each measurement."""
    if part.startswith("validate-sim"):
        return "measured, each beside the simulator's prediction (simulated) of the same configuration"
    return "measured"


def run_part(part: str, work: Path, tiny: bool) -> None:
    """Run `part` into `work`/`part`/ and write its result.json (what a child process does)."""
    out = work / part
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    payload = run(part, out, tiny)
    import sys
    if "torch" in sys.modules:
        import torch
        payload["torch"] = torch.__version__
    write_json(out / "result.json", {"part": part, "tiny": tiny, "method": method(part),
                                     "seconds": time.perf_counter() - t0, **payload})
    print(f"{part}: done in {time.perf_counter() - t0:.1f} s", flush=True)


app = typer.Typer(add_completion=False)


@app.command()
def _main(part: str = typer.Argument(..., help="the part to run"),
          work: Path = typer.Option(..., help="folder for this part's files"),
          tiny: bool = typer.Option(False, "--tiny")) -> None:
    """One part of make device-results, in a child process of its own."""
    run_part(part, work, tiny)


if __name__ == "__main__":
    app()
