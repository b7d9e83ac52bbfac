"""`make bench-replicas`: data-parallel replicas against one process, side by side.

On a compute-bound model (an MLP of wide Linear layers, one torch thread per process), the same
global mini-batch of N examples is trained by one process (GPipe K=1, runtime="distributed", one
rank) and by two (K=1 x R=2: each replica takes N/2, gradients summed by the bucketed all-reduce).
The ideal is twice the samples per second; the target is >= 0.90 of it. Runs alternate (1, 2, 1, 2,
...) so that the other load on the host hits both alike; the host is watched before and during the
run (report.host.HostWatch: other processes' CPU while it ran): on a busy 2-core host the ratio
measures the host as much as the engine, and the record says so.

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

import argparse
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from gpipe_repro.distributed import launch_local
from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.engine.timeline import Timeline
from gpipe_repro.report.host import BUSY_MARK, HostWatch, busy_note, is_clean, usable_cores
from gpipe_repro.report.records import markdown_table, measured, results_dir, write_json, write_markdown


def _layers(width: int, depth: int) -> list[nn.Module]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return layers + [nn.Linear(width, 10)]


def _batch(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)


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
    pipe = GPipe(_layers(width, depth), partitions=k, replicas=replicas, micro_batches=m,
                 checkpoint="never", loss_fn=nn.CrossEntropyLoss(), runtime="distributed",
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
    x, y = _batch(batch, width)
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
    pipe = GPipe(_layers(width, depth), partitions=1, micro_batches=1, checkpoint="never",
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
    x, y = _batch(batch, width)
    times = _step_times(pipe, x, y, warmup, steps)
    return {"times": times}


def train_lockstep(width: int, depth: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    """Runs in every process: :func:`train_alone`, but the processes wait for each other after every
    step (a barrier, no data). What a data-parallel job pays for its synchronization alone: each step
    lasts as long as the slower process's, so two cores that run at different speeds (a VM's
    hyperthreads, another tenant) cost the faster one its lead, before any all-reduce."""
    import torch.distributed as dist

    from gpipe_repro.distributed.process_group import init_distributed
    init_distributed()
    torch.set_num_threads(1)
    pipe = GPipe(_layers(width, depth), partitions=1, micro_batches=1, checkpoint="never",
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
    x, y = _batch(batch, width)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        pipe.train_step(x, y)
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
            "error": rep.step_time / measured_step - 1, "simulated_allreduce_s": rep.allreduce,
            "measured_allreduce_launch_to_done_s": observed, "simulated_exposed_s": rep.exposed,
            "link": link.to_json()}


def main(argv: list[str] | None = None) -> None:
    """Parse options, measure, print and record."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1024, help="global mini-batch")
    ap.add_argument("--m", type=int, default=1, help="micro-batches per replica")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of 1 and 2 processes")
    args = ap.parse_args(argv)
    common = (args.width, args.depth, args.batch, args.m, args.steps, args.warmup)
    one: list[float] = []
    two: list[float] = []
    half: list[float] = []       # one process, the replica's batch (N/2): the ideal at that batch
    pair: list[float] = []       # two processes at N/2 each, no all-reduce: this host's ceiling
    lockstep: list[float] = []   # the same, waiting for each other after every step: the sync cost
    alone = (args.width, args.depth, args.batch // 2, args.steps, args.warmup)
    load_before = os.getloadavg()
    with HostWatch() as watch:   # the host before, and what other processes did during the run
        for _ in range(args.rounds):
            one += launch_local(train_steps, 1, 1, 1, *common, timeout=120)[0]["times"]
            two += launch_local(train_steps, 2, 1, 2, *common, timeout=120)[0]["times"]
            half += launch_local(train_alone, 1, *alone, timeout=120)[0]["times"]
            for result in launch_local(train_alone, 2, *alone, timeout=120):   # each: N/2 per step
                pair += result["times"]
            lockstep += launch_local(train_lockstep, 2, *alone, timeout=120)[0]["times"]
    load_after = os.getloadavg()
    host = watch.conditions
    t1, t2 = statistics.median(one), statistics.median(two)
    t_half, t_pair = statistics.median(half), statistics.median(pair)
    t_lock = statistics.median(lockstep)
    speedup = t1 / t2
    efficiency = speedup / 2
    # The ideal from costs measured at the replica's batch (as every ideal in this project): two
    # processes each running N/2 at one process's speed at N/2.
    ideal_at_half = 2 * t1 / (2 * t_half)      # = t1 / t_half
    decomposition = {
        "ideal_2x_from_batch_n": 2.0,
        "ideal_from_cost_at_replica_batch": ideal_at_half,
        "two_independent_processes_speedup": t1 / t_pair,
        "data_parallel_speedup": speedup,
        "efficiency_vs_ideal_at_replica_batch": speedup / ideal_at_half,
        "efficiency_of_host_ceiling": (t1 / t_pair) / ideal_at_half,
        "efficiency_vs_host_ceiling": speedup / (t1 / t_pair),
        "two_processes_in_lockstep_speedup": t1 / t_lock,
        "efficiency_vs_lockstep": speedup / (t1 / t_lock),
    }
    rows = [["1 process (K=1, R=1), batch N", t1 * 1e3, args.batch / t1, 1.0, "-"],
            ["2 processes (K=1 x R=2), N/2 each", t2 * 1e3, args.batch / t2, speedup,
             f"{efficiency:.2f} of 2x (target >= 0.90); {speedup / ideal_at_half:.2f} of "
             f"{ideal_at_half:.2f}x (ideal at N/2)"],
            ["1 process, batch N/2 (x2 = ideal at N/2)", t_half * 1e3, args.batch / (2 * t_half),
             t1 / (2 * t_half), "-"],
            ["2 independent processes, N/2 each, no all-reduce", t_pair * 1e3, args.batch / t_pair,
             t1 / t_pair, f"{(t1 / t_pair) / ideal_at_half:.2f} of {ideal_at_half:.2f}x: this "
             "host's ceiling"],
            ["2 processes in lockstep, N/2 each, a barrier per step, no all-reduce", t_lock * 1e3,
             args.batch / t_lock, t1 / t_lock,
             f"{(t1 / t_lock) / ideal_at_half:.2f} of {ideal_at_half:.2f}x: the ceiling of any "
             "synchronous data parallelism here"]]
    table = markdown_table(["job", "median step ms (measured)", "samples/s", "speedup over 1 process",
                            "vs ideal"], rows)
    where = (f"Where the time goes: two independent trainings of N/2 reach {t1 / t_pair:.2f}x, "
             f"{(t1 / t_pair) / ideal_at_half:.2f} of the {ideal_at_half:.2f}x that one process's "
             "speed at N/2 promises (the host: two processes share caches and memory bandwidth); "
             f"waiting for each other after every step they reach {t1 / t_lock:.2f}x (each step "
             "lasts as long as the slower process's); the data-parallel job keeps "
             f"{speedup / (t1 / t_lock):.2f} of that (the all-reduce, whose gloo threads share the "
             "same 2 cores with compute).")
    cores = usable_cores()
    # Clean or busy (report.host.is_clean, as every measured table): the host idle before, and other
    # processes' CPU while it ran; the load average after includes this benchmark's own processes.
    busy = not is_clean(host)
    others = host["others_cpu_fraction_during"]
    note = (f"host idle {host['idle_fraction_before']:.0%} before"
            + ("" if others is None else f", other processes used {others:.0%} of its CPU during the run")
            + "; load average (1, 5, 15 min) before "
            f"{tuple(round(x, 2) for x in load_before)}, after {tuple(round(x, 2) for x in load_after)} "
            f"(this run's own processes included) on {cores} cores"
            + (f": {BUSY_MARK} the host was BUSY with other work{busy_note(host)}, so this ratio is "
               "not a clean measurement" if busy else ""))
    print(table)
    print(where)
    print(note)
    k2r2 = launch_local(train_steps, 4, 2, 2, args.width, args.depth, args.batch, 2, 3, 1, True,
                        timeout=120)
    gantt_timeline = k2r2[0]["timeline"]
    check = validate_simulator(k2r2, 2, 2, 2, args.batch, args.width)
    print(f"simulator vs measured K=2 x R=2 step: {check['simulated_step_s'] * 1e3:.1f} ms vs "
          f"{check['measured_step_s'] * 1e3:.1f} ms ({check['error']:+.0%}); all-reduce per stage "
          f"simulated {[round(a * 1e3, 1) for a in check['simulated_allreduce_s']]} ms, measured "
          f"launch-to-done {[round(a * 1e3, 1) for a in check['measured_allreduce_launch_to_done_s']]} ms")
    out = results_dir("replicas")
    write_json(out / "bench.json", {
        "experiment": "K=1 x R=2 data parallel vs one process", "config": vars(args),
        "median_step_s": {"one": measured(t1, unit="s"), "two": measured(t2, unit="s")},
        "speedup": measured(speedup), "efficiency_vs_ideal": measured(efficiency),
        "median_step_s_half_batch": {"one": measured(t_half, unit="s"),
                                     "two_independent": measured(t_pair, unit="s")},
        "decomposition": {key: measured(value) for key, value in decomposition.items()},
        "load_average": {"before": list(load_before), "after": list(load_after)}, "host_busy": busy,
        "conditions": host,
        "steps": {"one": one, "two": two, "one_half_batch": half, "two_independent_half_batch": pair},
        "timeline_k2_r2": gantt_timeline,
        "simulator_vs_measured_k2_r2": check})
    write_markdown(out / "bench.md", "# Data-parallel replicas vs one process (measured)\n\n"
                   f"MLP {args.depth}x{args.width}, global batch {args.batch}, one thread per process, "
                   f"median of {args.steps} steps x {args.rounds} alternating rounds. {note}.\n\n" + table
                   + f"\n\n{where}\n"
                   + f"\n\nSimulator vs measured K=2 x R=2 step (replayed compute + all-reduce model on "
                   f"the measured gloo loopback link): {check['simulated_step_s'] * 1e3:.1f} ms vs "
                   f"{check['measured_step_s'] * 1e3:.1f} ms ({check['error']:+.0%}). On this host the "
                   "all-reduce shares the 2 cores with compute, which the model does not know.\n"
                   "\n![K=2 x R=2 step](gantt_k2_r2.png)\n")
    try:
        from gpipe_repro.report.gantt import render_gantt
        render_gantt(Timeline.from_json(gantt_timeline), out / "gantt_k2_r2.png",
                     "K=2 x R=2 (rows: rank = replica * 2 + stage), measured")
    except ImportError as e:   # matplotlib missing: the JSON still holds the timeline
        print(f"no Gantt chart: {e}")
