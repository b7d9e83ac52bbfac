"""`make bench-replicas`: data-parallel replicas against one process, side by side.

On a compute-bound model (an MLP of wide Linear layers, one torch thread per process), the same
global mini-batch of N examples is trained by one process (GPipe K=1, runtime="distributed", one
rank) and by two (K=1 x R=2: each replica takes N/2, gradients summed by the bucketed all-reduce).
The jobs run in alternating rounds of the measurement kernel
(:mod:`gpipe_repro.report.measurement`), each launched afresh in every round, so that the other load
on the host hits all alike; every ratio is the median of per-round paired ratios with its 95%
interval. The figure of record: K=1 x R=2 against this host's ceiling measured in the same rounds
(two independent processes at N/2), target >= 0.90 of it.

Three more jobs say where a shortfall comes from: one process at the replica's batch N/2 (its
speed, twice, is the ideal from costs measured at that batch, as every ideal in this project); two
independent processes at N/2 with no gradient exchange (what two cores of this host give two
trainings at once); and the same two waiting for each other after every step, with no data (the
ceiling any synchronous data parallelism can reach here: a step lasts as long as the slower
process's).

It also records one K=2 x R=2 step's merged timeline (4 processes) and draws its Gantt chart, where
each stage's "AR" bar (its gradient all-reduce, from launch after its last backward to completion)
overlaps the drain of the stages before it. Results in results/replicas/ (measured).
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from gpipe_repro.distributed import launch_local
from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.engine.timeline import Timeline
from gpipe_repro.report.host import usable_cores
from gpipe_repro.report.measurement import Comparison, measure
from gpipe_repro.report.records import markdown_table, results_dir
from gpipe_repro.repro.harness import batch as batch_of
from gpipe_repro.repro.harness import check_publish, publish, relu_mlp, stop_rule, verdict_lines

COMMAND = "bench-replicas"


def _step_times(pipe: GPipe, x: torch.Tensor, y: torch.Tensor, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` training steps after `warmup` untimed ones."""
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        pipe.train_step(x, y)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def train_steps(k: int, replicas: int, width: int, depth: int, batch: int, m: int, steps: int,
                warmup: int, record: bool = False) -> dict[str, Any]:
    """Runs in every process: `warmup` + `steps` steps; step times (and a timeline if asked)."""
    pipe = GPipe(relu_mlp(width, depth), partitions=k, replicas=replicas, micro_batches=m,
                 checkpoint="never", loss_fn=nn.CrossEntropyLoss(), runtime="distributed",
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
    x, y = batch_of(width, batch)
    times = _step_times(pipe, x, y, warmup, steps)
    timeline = None
    params = sum(p.numel() for p in pipe.parameters())   # this rank's cell
    if record:
        pipe.record_timeline = True
        pipe.train_step(x, y)
        assert pipe.last_timeline is not None
        timeline = pipe.last_timeline.to_json()
    return {"times": times, "timeline": timeline, "params": params}


def train_alone(width: int, depth: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    """Runs in every process: the replica's share of the work with no gradient exchange (GPipe K=1,
    local runtime). Two of these at once measure what two cores give two independent trainings on
    this host (shared caches, memory bandwidth, a VM's sibling threads): the ceiling any data-parallel
    implementation can reach here, before its all-reduce costs anything."""
    torch.set_num_threads(1)
    pipe = GPipe(relu_mlp(width, depth), partitions=1, micro_batches=1, checkpoint="never",
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
    x, y = batch_of(width, batch)
    times = _step_times(pipe, x, y, warmup, steps)
    return {"times": times}


def train_lockstep(width: int, depth: int, batch: int, steps: int, warmup: int,
                   all_reduce: bool = False) -> dict[str, Any]:
    """Runs in every process: :func:`train_alone`, but the processes wait for each other after every
    step (a barrier, no data). What a data-parallel job pays for its synchronization alone: each step
    lasts as long as the slower process's, so two cores that run at different speeds (a VM's
    hyperthreads, another tenant) cost the faster one its lead, before any all-reduce.

    `all_reduce`: wait in a bare all-reduce (gloo) of as many bytes as the model's gradients
    instead: what a data-parallel step pays on this host where nothing overlaps the all-reduce, the
    bound the cores' own speed sets before any implementation's cost (K=1 x R=2 launches its buckets
    during the backward, but on two cores that both compute the all-reduce has no idle core to run
    on)."""
    import torch.distributed as dist

    from gpipe_repro.distributed.process_group import init_distributed
    init_distributed()
    torch.set_num_threads(1)
    pipe = GPipe(relu_mlp(width, depth), partitions=1, micro_batches=1, checkpoint="never",
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
    flat = torch.zeros(sum(p.numel() for p in pipe.parameters())) if all_reduce else None
    x, y = batch_of(width, batch)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        pipe.train_step(x, y)
        if flat is not None:
            dist.all_reduce(flat)
        else:
            dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"times": times}


def validate_simulator(result: list[dict[str, Any]], k: int, r: int, m: int, batch: int,
                       width: int) -> dict[str, Any]:
    """Simulated vs measured K x R step: replica 0's measured compute replayed through the simulator
    (:func:`gpipe_repro.sim.simulator.replay_costs`), plus the all-reduce model with this host's gloo
    loopback link (ping-pong measured) as the link class. Isolates the data-parallel model (the
    all-reduce's cost and its overlap) from the compute model. On a 2-core host with 4 processes the
    "link" is CPU time shared with compute, which the model does not know: the error shows that, it
    does not validate NVLink or InfiniBand numbers."""
    from gpipe_repro.engine.schedule import make_schedule
    from gpipe_repro.sim.data_parallel import CollectiveLink, replicate
    from gpipe_repro.sim.links import measure_gloo_loopback
    from gpipe_repro.sim.simulator import replay_costs, simulate

    timeline = Timeline.from_json(result[0]["timeline"])
    measured_step = statistics.median(result[0]["times"])
    replica0 = Timeline(k, [e for e in timeline.events if e.stage < k and e.kind != "allreduce"],
                        timeline.meta)
    link = measure_gloo_loopback()
    rows = batch // (r * m)
    costs = replay_costs(replica0, measured_step, [float(rows * width * 4)] * (k - 1))
    sim = simulate(make_schedule("gpipe", k, m, "never", False), costs, link, batch // r)
    grad_bytes = [4.0 * result[s]["params"] for s in range(k)]
    rep = replicate(sim, grad_bytes, replicas=r, devices_per_host=k * r,
                    intra=CollectiveLink(link.name, link.latency, link.bandwidth, link.source))
    observed = [e.duration for e in timeline.events if e.kind == "allreduce"]
    return {"measured_step_s": measured_step, "simulated_step_s": rep.step_time,
            # the sign of every simulator error of the project: simulated throughput / measured - 1
            "error": measured_step / rep.step_time - 1, "simulated_allreduce_s": rep.allreduce,
            "measured_allreduce_launch_to_done_s": observed, "simulated_exposed_s": rep.exposed,
            "link": link.to_json()}


JOBS = {
    "one": "1 process (K=1, R=1), batch N",
    "two": "2 processes (K=1 x R=2), N/2 each",
    "half": "1 process, batch N/2 (x2 = ideal at N/2)",
    "pair": "2 independent processes, N/2 each, no all-reduce: this host's ceiling",
    "lockstep": "2 processes in lockstep, N/2 each, a barrier per step, no all-reduce",
    "bound": "2 processes at N/2, then a bare all-reduce of the gradients' bytes: no overlap",
}
COMPARISONS = [
    Comparison("K=1 x R=2 / this host's ceiling (two independent processes at N/2)", "pair", "two",
               target=0.90, tolerance=0.03),
    Comparison("K=1 x R=2 speedup over one process (ideal 2x)", "one", "two", tolerance=0.03),
    Comparison("this host's ceiling: two independent processes at N/2 over one at N", "one", "pair",
               tolerance=0.03),
    Comparison("ideal from the cost at N/2: one process at N over one at N/2", "one", "half",
               tolerance=0.03),
    Comparison("two processes in lockstep at N/2 over one at N", "one", "lockstep", tolerance=0.03),
    Comparison("K=1 x R=2 / two processes in lockstep", "lockstep", "two", tolerance=0.03),
    Comparison("the bound with the all-reduce unoverlapped / this host's ceiling", "pair", "bound",
               tolerance=0.03),
    Comparison("K=1 x R=2 / the bound with the all-reduce unoverlapped", "bound", "two", tolerance=0.03),
]


def jobs(width: int, depth: int, n: int, m: int, steps: int, warmup: int) -> dict[str, Any]:
    """Each job of a round: launched afresh, returning its median step time (seconds)."""
    common = (width, depth, n, m, steps, warmup)
    alone = (width, depth, n // 2, steps, warmup)

    def median_of(*runs: dict[str, Any]) -> float:
        return statistics.median(t for r in runs for t in r["times"])
    return {"one": lambda: median_of(launch_local(train_steps, 1, 1, 1, *common, timeout=120)[0]),
            "two": lambda: median_of(launch_local(train_steps, 2, 1, 2, *common, timeout=120)[0]),
            "half": lambda: median_of(launch_local(train_alone, 1, *alone, timeout=120)[0]),
            "pair": lambda: median_of(*launch_local(train_alone, 2, *alone, timeout=120)),
            "lockstep": lambda: median_of(launch_local(train_lockstep, 2, *alone, timeout=120)[0]),
            "bound": lambda: median_of(launch_local(train_lockstep, 2, *alone, True, timeout=120)[0])}


def main(*, width: int = 1024, depth: int = 4, batch: int = 1024, m: int = 1, steps: int = 4,
         warmup: int = 2, write: bool = True, budget: float = 600.0, tolerance: float = 0.03,
         min_rounds: int = 5, max_rounds: int = 30) -> None:
    """Measure, print and (unless `write` is False) record under results/replicas/."""
    if usable_cores() < 2:
        raise ValueError(f"bench-replicas runs 2 processes on one core each; this host has "
                         f"{usable_cores()}")
    check_publish("replicas", "bench", COMMAND, extra=("gantt_k2_r2.png",), write=write)
    config = {"width": width, "depth": depth, "batch": batch, "m": m, "steps": steps, "warmup": warmup,
              "write": write, "budget": budget, "tolerance": tolerance, "min_rounds": min_rounds,
              "max_rounds": max_rounds}
    result = measure(jobs(width, depth, batch, m, steps, warmup), COMPARISONS,
                     stop_rule(budget, tolerance, min_rounds, max_rounds), label="bench-replicas")
    t = {name: f.value for name, f in result.times.items()}
    table = markdown_table(["job", "median step ms [95% interval]", "samples/s"],
                           [[JOBS[n], f.markdown(), batch / f.value] for n, f in result.times.items()])
    text = (f"# Data-parallel replicas vs one process (measured)\n\nMLP {depth}x{width}, "
            f"global batch {batch}, one thread per process; {result.rounds} rounds of the "
            f"{len(JOBS)} jobs, alternating ({result.stopped}); each ratio is the median of per-round "
            "paired ratios with its 95% interval. The target: K=1 x R=2 reaches >= 0.90 of "
            "what two independent processes at N/2 reach on this host in the same rounds (its "
            "ceiling: shared caches, memory bandwidth and a VM's cores that switch speed). The "
            "ceiling has no all-reduce; 'the bound' adds a bare all-reduce of the gradients' bytes "
            "after each step, unoverlapped: on two cores that both compute, what the all-reduce "
            "itself costs here, before any implementation's own.\n\n"
            + verdict_lines(list(result.figures.values())) + "\n\n" + table)
    k2r2 = launch_local(train_steps, 4, 2, 2, width, depth, batch, 2, 3, 1, True,
                        timeout=120)
    check = validate_simulator(k2r2, 2, 2, 2, batch, width)
    text += (f"\n\nSimulator vs measured K=2 x R=2 step (replayed compute + all-reduce model on the "
             f"measured gloo loopback link): {check['simulated_step_s'] * 1e3:.1f} ms vs "
             f"{check['measured_step_s'] * 1e3:.1f} ms measured (one run's median step; error, simulated "
             f"throughput / measured - 1: {check['error']:+.0%}); all-reduce per stage "
             f"simulated {[round(a * 1e3, 1) for a in check['simulated_allreduce_s']]} ms, measured "
             f"launch-to-done {[round(a * 1e3, 1) for a in check['measured_allreduce_launch_to_done_s']]}"
             " ms. On this host the all-reduce shares the 2 cores with compute, which the model does "
             "not know.\n\n![K=2 x R=2 step](gantt_k2_r2.png)\n")
    publish("replicas", "bench", {
        "experiment": "K=1 x R=2 data parallel vs one process", "config": config,
        "measurement": result.to_json(), "median_step_s": t,
        "timeline_k2_r2": k2r2[0]["timeline"], "simulator_vs_measured_k2_r2": check},
        text, command=COMMAND, write=write)
    if write:
        try:
            from gpipe_repro.report.gantt import render_gantt
            render_gantt(Timeline.from_json(k2r2[0]["timeline"]), results_dir("replicas") / "gantt_k2_r2.png",
                         "K=2 x R=2 (rows: rank = replica * 2 + stage), measured")
        except ImportError as e:   # matplotlib missing: the JSON still holds the timeline
            print(f"no Gantt chart: {e}")
