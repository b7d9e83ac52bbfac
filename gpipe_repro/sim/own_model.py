"""Simulate your own model: per-layer costs calibrated on this device, the exact partitioner, and the
runtime's own schedule in virtual time, for any K, M and re-materialization mode.

::

    from gpipe_repro.models.workload import Workload
    from gpipe_repro.sim.own_model import simulate_model

    work = Workload.create("my MLP", "mypackage.models:make_mlp", "features", (784,), 10, width=1024)
    result = simulate_model(work, k=4, m=8, microbatch=32)
    print(result.describe())

or ``gpipe-repro throughput --model mypackage.models:make_mlp --input-shape 784 --classes 10
--k 4 --m 8``. The factory returns an ``nn.Sequential`` (or a list of layers); its keyword arguments
are the workload's options. The defaults are :class:`gpipe_repro.GPipe`'s (``checkpoint=
"except_last"``, ``recompute_ahead=False``), so the simulated pipeline is the one ``GPipe(layers,
partitions=K, micro_batches=M)`` builds.

Step time is one training step of a mini-batch of ``M x microbatch`` examples. Speedup is the
simulated throughput over that of the same mini-batch on one device with no pipeline and no
re-materialization (K=1, M=1, ``checkpoint="never"``: plain training). Where K fits the host (one core
per stage on a CPU), the configuration is also run for real on K stage processes and the simulator's
error is reported beside it.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.partition import OBJECTIVES
from gpipe_repro.engine.schedule import CHECKPOINT_MODES, make_schedule
from gpipe_repro.models.workload import Workload
from gpipe_repro.report.host import HostWatch, is_clean, usable_cores
from gpipe_repro.sim.calibration import calibrate
from gpipe_repro.sim.links import LINK_NAMES
from gpipe_repro.sim.partition_choice import choose_partition
from gpipe_repro.sim.platform import platform_for
from gpipe_repro.sim.simulator import simulate_config
from gpipe_repro.sim.tied import cell_ties, layer_ties, with_tied_allreduce


@dataclass
class OwnModelResult:
    """What :func:`simulate_model` found (seconds, samples per second)."""

    workload: str
    K: int
    M: int
    microbatch: int
    checkpoint: str
    recompute_ahead: bool
    balance: list[int]
    step_time_s: float
    throughput: float
    single_device_step_time_s: float
    speedup: float
    bubble_fraction: float
    measured_step_time_s: float | None = None
    relative_error: float | None = None        # simulated throughput / measured - 1
    measured_host: dict[str, Any] | None = None
    measured_step_times_s: list[float] | None = None
    in_situ: dict[str, Any] | None = None      # the uncorrected step time and the factors applied

    def describe(self) -> str:
        """A few lines for a terminal."""
        lines = [f"{self.workload}: K={self.K}, M={self.M}, micro-batch {self.microbatch} "
                 f"(mini-batch {self.M * self.microbatch}), checkpoint {self.checkpoint}"
                 f"{', recompute ahead' if self.recompute_ahead else ''}",
                 f"  partition {self.balance}",
                 f"  simulated step {self.step_time_s * 1e3:.1f} ms, {self.throughput:.1f} samples/s, "
                 f"bubble {self.bubble_fraction:.1%}",
                 f"  speedup {self.speedup:.2f}x over one device without a pipeline "
                 f"(simulated {self.single_device_step_time_s * 1e3:.1f} ms per step)"]
        if self.measured_step_time_s is not None and self.relative_error is not None:
            busy = "" if is_clean(self.measured_host) else \
                " (host was busy: not a clean measurement)"
            side = "optimistic" if self.relative_error > 0 else "pessimistic"
            lines.append(f"  measured on {self.K} stage processes: step "
                         f"{self.measured_step_time_s * 1e3:.1f} ms; simulator error "
                         f"{self.relative_error:+.1%} (measured / simulated - 1: the simulator is "
                         f"{side}){busy}")
            if abs(self.relative_error) > 0.25 and self.measured_step_time_s < 0.02:
                lines.append("  note: steps this short are dominated by per-message and per-step "
                             "costs the calibration does not see well; use a larger --microbatch "
                             "for a step of at least 20 ms")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """As a plain dictionary."""
        return asdict(self)


def simulate_model(workload: Workload, *, k: int, m: int, microbatch: int,
                   checkpoint: str = "except_last", recompute_ahead: bool = False,
                   schedule: str = "gpipe", objective: str = "bottleneck",
                   link: str = "gloo-loopback", device: str = "cpu", threads: int | None = 1,
                   repeats: int = 20, method: str = "time", validate: bool | None = None,
                   steps: int = 4, in_situ: bool = False) -> OwnModelResult:
    """Calibrate `workload`, partition it into `k` cells and simulate one GPipe step of `m`
    micro-batches of `microbatch` examples (see the module docstring).

    `validate`: run the configuration on `k` real stage processes too (None: where `k` fits the
    usable cores and the device is a CPU). `in_situ`: correct the stage costs from a short run of the
    chosen partition at one micro-batch per step on the real stage processes
    (:mod:`gpipe_repro.sim.in_situ`; a CPU host with `k` cores). All options are checked before any
    work starts."""
    if k < 1 or m < 1 or microbatch < 1:
        raise ValueError(f"k, m and microbatch must be >= 1, got k={k}, m={m}, microbatch={microbatch}")
    require_one_of("checkpoint", checkpoint, CHECKPOINT_MODES)
    require_one_of("objective", objective, OBJECTIVES)
    require_one_of("link", link, LINK_NAMES)
    if (validate or in_situ) and (device != "cpu" or k > usable_cores()):
        raise ValueError(f"validation runs K={k} stage processes on one core each, but this host has "
                         f"{usable_cores()} usable core(s): use k <= {usable_cores()} or validate=False")
    layers = len(workload.build("meta"))
    if k > layers:
        raise ValueError(f"k={k} cells for a model of {layers} layers: use k <= {layers}")
    n = m * microbatch
    neighbours = max(0, min(usable_cores(), k) - 1) if device == "cpu" and method == "time" else 0
    calib = calibrate(workload, sorted({microbatch, n}), method=method, device=device,
                      threads=threads, repeats=repeats, neighbours=neighbours)
    platform = platform_for(link)
    balance = choose_partition(calib.partition_costs(microbatch, checkpoint), k, objective,
                               calib.uncertainty_at(microbatch))
    # a step's fixed costs of stage processes (clock, agreement): none for one cell in one process
    sim = simulate_config(calib, balance, m, n, platform.link, checkpoint=checkpoint,
                          recompute_ahead=recompute_ahead, schedule=schedule,
                          setup=platform.setup if k > 1 else 0.0,
                          teardown=platform.teardown if k > 1 else 0.0)
    situ_record: dict[str, Any] = {}
    if in_situ:
        sim = _corrected(workload, calib, balance, m, microbatch, checkpoint, recompute_ahead, schedule,
                         platform, threads or 1, situ_record)
    ties = cell_ties(layer_ties(list(workload.build("meta"))), balance)
    if ties:   # parameters tied across cells: their gradients' all-reduce at AGREE
        sim = with_tied_allreduce(sim, make_schedule(schedule, k, m, checkpoint, recompute_ahead), ties,
                                  platform.link)
    single = simulate_config(calib, [layers], 1, n, platform.link, checkpoint="never",
                             recompute_ahead=False, schedule=schedule)
    result = OwnModelResult(workload.name, k, m, microbatch, checkpoint, recompute_ahead, balance,
                            sim.step_time, sim.throughput, single.step_time,
                            sim.throughput / single.throughput, sim.bubble_fraction)
    if in_situ:
        result.in_situ = situ_record
    if validate is None:
        validate = device == "cpu" and 2 <= k <= usable_cores()
    if validate:
        from gpipe_repro.distributed.measure import measure_pipeline

        with HostWatch() as watch:       # idle before, other processes' CPU during
            measured = measure_pipeline(functools.partial(workload.build, "cpu"), balance, m,
                                        workload.sample(n), checkpoint=checkpoint,
                                        recompute_ahead=recompute_ahead, schedule=schedule,
                                        loss_fn=workload.loss_fn(), steps=steps, warmup=2,
                                        threads=threads or 1)
        host = watch.conditions
        result.measured_step_time_s = float(measured.median_step_time)
        result.relative_error = measured.median_step_time / sim.step_time - 1.0
        result.measured_host = host
        result.measured_step_times_s = [float(t) for t in measured.step_times]
    return result


def _corrected(workload: Workload, calib: Any, balance: list[int], m: int, microbatch: int,
               checkpoint: str, recompute_ahead: bool, schedule: str, platform: Any, threads: int,
               record: dict[str, Any]) -> Any:
    """The simulation with stage costs corrected from a short M=1 run (:mod:`gpipe_repro.sim.in_situ`);
    `record` receives the uncorrected step time and the factors."""
    from gpipe_repro.engine.microbatch import split_sizes
    from gpipe_repro.engine.schedule import make_schedule
    from gpipe_repro.sim import in_situ as situ
    from gpipe_repro.sim.simulator import simulate, stage_costs

    setup, teardown = (platform.setup, platform.teardown) if len(balance) > 1 else (0.0, 0.0)
    n = m * microbatch
    short = situ.in_situ_timelines(functools.partial(workload.build, "cpu"), balance,
                                   workload.sample(microbatch), checkpoint=checkpoint, schedule=schedule,
                                   loss_fn=workload.loss_fn(), threads=threads)
    one = simulate_config(calib, balance, 1, microbatch, platform.link, checkpoint=checkpoint,
                          schedule=schedule, setup=setup, teardown=teardown)
    per_stage = situ.factors(short, one.timeline)
    costs = situ.scaled(stage_costs(calib, balance, split_sizes(n, m), setup, teardown), per_stage)
    uncorrected = simulate_config(calib, balance, m, n, platform.link, checkpoint=checkpoint,
                                  recompute_ahead=recompute_ahead, schedule=schedule, setup=setup,
                                  teardown=teardown)
    record.update({"uncorrected_step_time_s": uncorrected.step_time, "factors": per_stage,
                   "run": "M=1, one micro-batch per step, 3 steps after 1 warm-up"})
    return simulate(make_schedule(schedule, len(balance), m, checkpoint, recompute_ahead), costs,
                    platform.link, n)
