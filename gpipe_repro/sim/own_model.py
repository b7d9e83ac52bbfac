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
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.microbatch import split_sizes
from gpipe_repro.engine.partition import OBJECTIVES
from gpipe_repro.engine.schedule import CHECKPOINT_MODES, make_schedule
from gpipe_repro.models.workload import Workload
from gpipe_repro.report.host import HostWatch, busy_readings, fast_share, is_clean, usable_cores
from gpipe_repro.report.measurement import Figure, median_interval
from gpipe_repro.sim import in_situ as situ
from gpipe_repro.sim.calibration import Calibration, calibrate
from gpipe_repro.sim.error import error_figure, paired_error_figure
from gpipe_repro.sim.links import LINK_NAMES
from gpipe_repro.sim.partition_choice import choose_partition
from gpipe_repro.sim.platform import platform_for
from gpipe_repro.sim.simulator import simulate, simulate_config, stage_costs
from gpipe_repro.sim.tied import cell_ties, layer_ties, with_tied_allreduce


@dataclass
class OwnModelResult:
    """What :func:`simulate_model` found (seconds, samples per second).

    With the in-situ correction, `step_time_s`, `throughput` and `bubble_fraction` are the corrected
    simulation's and `relative_error` is its error; `in_situ` holds the uncorrected simulation, its
    error, the factors and the in-situ run. `speedup` is always the calibrated costs' on both sides
    (the correction is measured on the pipeline's stages only, not on one device without one); it
    is None where the costs were calibrated at the micro-batch size only (:func:`predict`)."""

    workload: str
    K: int
    M: int
    microbatch: int
    checkpoint: str
    recompute_ahead: bool
    balance: list[int]
    step_time_s: float
    throughput: float
    single_device_step_time_s: float | None
    speedup: float | None
    bubble_fraction: float
    measured_step_time_s: float | None = None
    relative_error: float | None = None        # simulated throughput / measured - 1
    measured_host: dict[str, Any] | None = None
    measured_step_times_s: list[float] | None = None
    in_situ: dict[str, Any] | None = None      # the uncorrected simulation, the factors, the run
    rounds: int = 1                            # measured rounds, each after a calibration of its own
    measured_step_times_per_round_s: list[list[float]] | None = None   # in rounds: each round's steps,
    uncorrected_step_per_round_s: list[float] | None = None           # and its simulated step
    calibrated: dict[str, Any] | None = None   # "cached", or the host's fast share around the timing

    @property
    def uncorrected_step_time_s(self) -> float:
        """The simulated step from the calibrated costs alone."""
        return self.in_situ["uncorrected_step_time_s"] if self.in_situ else self.step_time_s

    def error(self, corrected: bool = True) -> Figure | None:
        """The error of the (corrected, else the uncorrected) simulated throughput against each
        measured step: its median and 95% interval; None without a measurement. Uncorrected and
        measured in rounds: each round's steps against the simulation from that round's costs."""
        per_round = self.uncorrected_step_per_round_s
        if per_round and self.measured_step_times_per_round_s and not (corrected and self.in_situ):
            return paired_error_figure(list(zip(self.measured_step_times_per_round_s, per_round)))
        steps = self.measured_step_times_s or (
            [self.measured_step_time_s] if self.measured_step_time_s is not None else [])
        if not steps:
            return None
        return error_figure(steps, self.step_time_s if corrected else self.uncorrected_step_time_s)

    def describe(self) -> str:
        """A few lines for a terminal."""
        record = self.in_situ
        lines = [f"{self.workload}: K={self.K}, M={self.M}, micro-batch {self.microbatch} "
                 f"(mini-batch {self.M * self.microbatch}), checkpoint {self.checkpoint}"
                 f"{', recompute ahead' if self.recompute_ahead else ''}",
                 f"  partition {self.balance}"]
        if record:
            lines.append(f"  simulated step, uncorrected: {record['uncorrected_step_time_s'] * 1e3:.1f} ms, "
                         f"{record['uncorrected_throughput']:.1f} samples/s")
            lines.append(f"  in-situ factors ({record['run']}), measured / calibrated seconds per action "
                         f"kind: " + "; ".join(
                             f"stage {s}: " + ", ".join(f"{kind} {f:.2f}" for kind, f in per.items())
                             for s, per in enumerate(record["factors"])))
        which = ", in-situ corrected:" if record else ""
        lines.append(f"  simulated step{which} {self.step_time_s * 1e3:.1f} ms, "
                     f"{self.throughput:.1f} samples/s, bubble {self.bubble_fraction:.1%}"
                     f"{_calibrated(self.calibrated)}")
        if self.speedup is not None and self.single_device_step_time_s is not None:
            lines.append(f"  speedup {self.speedup:.2f}x over one device without a pipeline "
                         f"(simulated {self.single_device_step_time_s * 1e3:.1f} ms per step"
                         f"{', both from the calibrated costs' if record else ''})")
        error = self.error()
        if self.measured_step_time_s is not None and error is not None:
            busy = _busy(self.measured_host)
            side = "optimistic" if error.value > 0 else "pessimistic"
            spread = (f" in {self.rounds} rounds, the costs calibrated again before each, each "
                      "round's steps against its own costs"
                      if self.rounds > 1 else "")
            steps = self.measured_step_times_s or [self.measured_step_time_s]
            low, high, how = median_interval(steps, per="steps")
            interval = (f" [{low * 1e3:.1f}, {high * 1e3:.1f}]" if low is not None and high is not None
                        else "")
            lines.append(f"  measured on {self.K} stage processes: step "
                         f"{self.measured_step_time_s * 1e3:.1f} ms{interval} (median of "
                         f"{len(steps)} steps{spread}; interval: {how}){busy}")
            if record:
                raw = self.error(corrected=False)
                assert raw is not None
                lines.append(f"  simulator error (measured / simulated - 1) [95% interval, or the coverage "
                             f"shown after it]: uncorrected "
                             f"{raw.percent_cell()}, in-situ corrected {error.percent_cell()} (the corrected "
                             f"simulator is {side})")
            else:
                lines.append(f"  simulator error {error.percent_cell()} (measured / simulated - 1 [95% "
                             f"interval, or the coverage shown after it]: the simulator is {side})")
            if self.rounds > 1 and self.relative_error is not None:
                lines.append(f"  (the error pairs each round's steps with that round's simulation; the "
                             f"two medians above, from all rounds' costs, give "
                             f"{self.relative_error:+.1%})")
            if abs(error.value) > 0.25 and self.measured_step_time_s < 0.02:
                lines.append("  note: steps this short are dominated by per-message and per-step "
                             "costs the calibration does not see well; use a larger --microbatch "
                             "for a step of at least 20 ms")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """As a plain dictionary."""
        return asdict(self)


def _busy(host: dict[str, Any] | None) -> str:
    """A busy or slow host, said with what was seen (the error's interval spans what it did); ""
    for a clean or unrecorded one."""
    if host is None or is_clean(host) is not False:
        return ""
    return f" (host busy or slow: {busy_readings(host)}; the error's interval spans it)"



def simulate_model(workload: Workload, *, k: int, m: int, microbatch: int,
                   checkpoint: str = "except_last", recompute_ahead: bool = False,
                   schedule: str = "gpipe", objective: str = "bottleneck",
                   link: str = "gloo-loopback", device: str = "cpu", threads: int | None = 1,
                   repeats: int = 20, method: str = "time", validate: bool | None = None,
                   steps: int = 4, in_situ: bool = False, in_situ_steps: int = 3,
                   in_situ_microbatches: int = 1, rounds: int = 1,
                   progress: Callable[[str], None] | None = None) -> OwnModelResult:
    """Calibrate `workload`, partition it into `k` cells and simulate one GPipe step of `m`
    micro-batches of `microbatch` examples (see the module docstring).

    `validate`: run the configuration on `k` real stage processes too (None: where `k` fits the
    usable cores and the device is a CPU), `steps` steps in each of `rounds` rounds. With more
    than one round the costs at the micro-batch size are calibrated afresh right before every round,
    the error pairs each round's steps with the simulation from that round's costs (the host's speed
    drifts over minutes; the first calibration, which gives the cut and the speedup over one device,
    may be the cache's, from another hour), and the simulated step comes from the median of the
    rounds' calibrations (:meth:`Calibration.median_of`): the costs and the measured steps sample
    the same stretch of the host's states instead of one calibration against one burst of steps.
    With the in-situ correction its factors divide by that median. `in_situ`: correct
    the stage costs from a short run of the chosen partition at `in_situ_microbatches` micro-batches
    per step (`in_situ_steps` steps) on the real stage processes (:mod:`gpipe_repro.sim.in_situ`; a
    CPU host with `k` cores), a run of its own, before and apart from the validation's. All options
    are checked before any work starts. `progress`: told what runs now (a line per phase and per
    calibrated layer)."""
    check_options(workload, k=k, m=m, microbatch=microbatch, checkpoint=checkpoint, schedule=schedule,
                  objective=objective, link=link, device=device, validate=validate,
                  in_situ=in_situ, in_situ_steps=in_situ_steps,
                  in_situ_microbatches=in_situ_microbatches)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    n = m * microbatch
    neighbours = calibration_neighbours(k, device, method)
    said: list[str] = []
    tell = progress or (lambda line: None)

    def heard(line: str) -> None:
        said.append(line)
        tell(f"calibrating: {line}")
    timed_on_cpu = method == "time" and device == "cpu"
    before = fast_share() if timed_on_cpu else None
    calib = calibrate(workload, sorted({microbatch, n}), method=method, device=device,
                      threads=threads, repeats=repeats, neighbours=neighbours, progress=heard)
    calibrated: dict[str, Any] = (
        {"cached": True} if said and all(line.endswith("cached)") for line in said) else
        {"cached": False, "host_fast": None if before is None else (before + fast_share()) / 2})
    balance = choose_partition(calib.partition_costs(microbatch, checkpoint), k, objective,
                               calib.uncertainty_at(microbatch))
    if in_situ:
        tell(f"in-situ run of the cut {balance} on {k} stage processes ({in_situ_steps} steps)")
    timelines = (in_situ_run(workload, balance, microbatch=microbatch, checkpoint=checkpoint,
                             schedule=schedule, threads=threads, steps=in_situ_steps,
                             micro_batches=in_situ_microbatches) if in_situ else None)
    if validate is None:
        validate = device == "cpu" and 2 <= k <= usable_cores()
    result = predict(workload, calib, balance, m=m, microbatch=microbatch, checkpoint=checkpoint,
                     recompute_ahead=recompute_ahead, schedule=schedule, link=link,
                     in_situ_timelines=timelines, in_situ_steps=in_situ_steps,
                     in_situ_microbatches=in_situ_microbatches, jitter=validate)
    result.calibrated = calibrated
    if validate:
        # in rounds, each round's steps against the costs calibrated right before them (the first
        # calibration may be the cache's, from another hour): a paired ratio per round
        calibrations, steps_s, hosts = [], [], []
        for r in range(rounds):
            if rounds > 1:
                tell(f"round {r + 1} of {rounds}: calibrating the layers again")
                calibrations.append(calibrate(workload, [microbatch], method=method, device=device,
                                              threads=threads, repeats=repeats, use_cache=False,
                                              neighbours=neighbours))
            tell(f"round {r + 1} of {rounds}: {steps} measured steps of the cut {balance} on {k} "
                 f"stage processes, M={m}")
            got, host = measure_steps(workload, balance, m=m, microbatch=microbatch,
                                      checkpoint=checkpoint, recompute_ahead=recompute_ahead,
                                      schedule=schedule, threads=threads, steps=steps)
            steps_s.append(list(got))
            hosts.append(host)
        if rounds > 1:
            first = result
            result = predict(workload, Calibration.median_of(calibrations), balance, m=m,
                             microbatch=microbatch, checkpoint=checkpoint,
                             recompute_ahead=recompute_ahead, schedule=schedule, link=link,
                             in_situ_timelines=timelines, in_situ_steps=in_situ_steps,
                             in_situ_microbatches=in_situ_microbatches, jitter=True)
            # the speedup compares two simulations of one calibration: the first's, the only one
            # timed at the whole mini-batch too
            result.speedup = first.speedup
            result.single_device_step_time_s = first.single_device_step_time_s
            result.calibrated = {"cached": False, "host_fast": None, "rounds": rounds}
        attach_measurement(result, [t for got in steps_s for t in got], worst_host(hosts))
        result.rounds = rounds
        if rounds > 1:
            result.measured_step_times_per_round_s = steps_s
            result.uncorrected_step_per_round_s = [
                predict(workload, cal, balance, m=m, microbatch=microbatch, checkpoint=checkpoint,
                        recompute_ahead=recompute_ahead, schedule=schedule, link=link,
                        jitter=True).step_time_s for cal in calibrations]
    return result


#: How the conditions of several runs combine into the worst of them, per reading.
_WORST = {"idle_fraction_before": min, "others_cpu_fraction_during": max, "load_average_before": max,
          "load_average_after": max, "speed_before": min, "speed_after": min, "speed_fastest": max}


def worst_host(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The host's conditions over several runs (:class:`HostWatch`), as one, each reading the worst
    any run saw (the least idle, the most other CPU and load, the slowest speed probe against the
    fastest): what :func:`gpipe_repro.report.host.is_clean` judges, over all of them."""
    host = dict(runs[0])
    for key, worst in _WORST.items():
        seen = [r[key] for r in runs if r.get(key) is not None]
        if seen:
            host[key] = worst(seen)
    return host


def check_options(workload: Workload, *, k: int, m: int, microbatch: int, checkpoint: str,
                  schedule: str, objective: str, link: str, device: str, validate: bool | None,
                  in_situ: bool, in_situ_steps: int = 3, in_situ_microbatches: int = 1) -> None:
    """Refuse, before any work, what :func:`simulate_model` could not do (the message says what to
    change)."""
    if min(k, m, microbatch, in_situ_steps, in_situ_microbatches) < 1:
        raise ValueError(f"k, m, microbatch, in_situ_steps and in_situ_microbatches must be >= 1, got k={k}, "
                         f"m={m}, microbatch={microbatch}, in_situ_steps={in_situ_steps}, "
                         f"in_situ_microbatches={in_situ_microbatches}")
    require_one_of("checkpoint", checkpoint, CHECKPOINT_MODES)
    require_one_of("objective", objective, OBJECTIVES)
    require_one_of("link", link, LINK_NAMES)
    if validate and (device != "cpu" or k > usable_cores()):
        raise ValueError(f"validation runs K={k} stage processes on one core each, but this host has "
                         f"{usable_cores()} usable core(s): use k <= {usable_cores()} or validate=False")
    if in_situ:
        situ.check(schedule, k, usable_cores(), device)
    layers = len(workload.build("meta"))
    if k > layers:
        raise ValueError(f"k={k} cells for a model of {layers} layers: use k <= {layers}")


def _calibrated(note: dict[str, Any] | None) -> str:
    """Where the simulated step's costs came from, for :meth:`OwnModelResult.describe`: a figure
    simulated from costs timed on a busy host is slower by as much as they are."""
    if not note:
        return ""
    if note.get("cached"):
        return " (costs from the calibration cache, GPIPE_REPRO_CACHE)"
    if note.get("rounds"):
        return f" (costs: the median of {note['rounds']} calibrations, one before each round)"
    if note.get("host_fast") is None:
        return ""
    return (f" (costs timed now, the host fast {note['host_fast']:.0%} of the time around it: a busier "
            "host times every cost slower, and this step with them)")


def calibration_neighbours(k: int, device: str, method: str = "time") -> int:
    """The busy neighbour cores a calibration for a `k`-stage pipeline runs beside: the pipeline's
    other stages that share this host's cores (timed costs on a CPU only)."""
    return max(0, min(usable_cores(), k) - 1) if device == "cpu" and method == "time" else 0


def in_situ_run(workload: Workload, balance: list[int], *, microbatch: int, checkpoint: str,
                schedule: str, threads: int | None, steps: int, micro_batches: int) -> list[Any]:
    """The in-situ correction's own run (:func:`gpipe_repro.sim.in_situ.in_situ_timelines`): the cut
    trained for `steps` steps of `micro_batches` micro-batches on the real stage processes; its
    timelines."""
    return situ.in_situ_timelines(functools.partial(workload.build, "cpu"), balance,
                                  workload.sample(micro_batches * microbatch),
                                  checkpoint=checkpoint, schedule=schedule,
                                  loss_fn=workload.loss_fn(), threads=threads or 1,
                                  steps=steps, micro_batches=micro_batches)


def predict(workload: Workload, calib: Calibration, balance: list[int], *, m: int, microbatch: int,
            checkpoint: str, recompute_ahead: bool = False, schedule: str = "gpipe",
            link: str = "gloo-loopback", in_situ_timelines: list[Any] | None = None,
            in_situ_steps: int = 3, in_situ_microbatches: int = 1,
            jitter: bool = False) -> OwnModelResult:
    """The simulated step of cut `balance` at M = `m` micro-batches of `microbatch` from `calib`'s
    costs, corrected in situ where `in_situ_timelines` (:func:`in_situ_run`) are given; the speedup
    over one device where `calib` holds the whole mini-batch's size (else None). `jitter`: the
    prediction is compared with steps measured on this host's stage processes, so its action
    durations are drawn as they vary in a pipeline here (:mod:`gpipe_repro.sim.jitter`; the host's
    gloo link only)."""
    k, n = len(balance), m * microbatch
    platform = platform_for(link, jitter=jitter)
    # a step's fixed costs of stage processes (clock, agreement): none for one cell in one process
    setup, teardown = (platform.setup, platform.teardown) if k > 1 else (0.0, 0.0)
    sched = make_schedule(schedule, k, m, checkpoint, recompute_ahead)
    sim = simulate(sched, stage_costs(calib, balance, split_sizes(n, m), setup, teardown), platform.link, n,
                   platform.jitter)
    corrected = None
    situ_record: dict[str, Any] = {}
    if in_situ_timelines is not None:
        mode = situ.run_checkpoint(checkpoint, in_situ_microbatches)
        costs, per_stage = situ.corrected_costs(calib, balance, m, n, in_situ_timelines, link=platform.link,
                                                checkpoint=checkpoint, schedule=schedule, setup=setup,
                                                teardown=teardown, micro_batches=in_situ_microbatches)
        corrected = simulate(sched, costs, platform.link, n, platform.jitter)
        situ_record = {"factors": per_stage, "checkpoint": mode, "steps": in_situ_steps,
                       "micro_batches": in_situ_microbatches,
                       "step_times_s": [float(t.meta.get("step_time_s", t.makespan))
                                        for t in in_situ_timelines],
                       "run": f"a separate run: M={in_situ_microbatches}, {in_situ_steps} steps after 1 "
                              f"warm-up, checkpoint {mode}"}
    layers = list(workload.build("meta"))
    ties = cell_ties(layer_ties(layers), balance)
    if ties:   # parameters tied across cells: their gradients' all-reduce at AGREE
        sim = with_tied_allreduce(sim, sched, ties, platform.link)
        if corrected is not None:
            corrected = with_tied_allreduce(corrected, sched, ties, platform.link)
    single = (simulate_config(calib, [len(layers)], 1, n, platform.link, checkpoint="never",
                              recompute_ahead=False, schedule=schedule, jitter=platform.jitter)
              if n in calib.costs else None)
    prediction = corrected if corrected is not None else sim
    result = OwnModelResult(workload.name, k, m, microbatch, checkpoint, recompute_ahead, balance,
                            prediction.step_time, prediction.throughput,
                            single.step_time if single else None,
                            sim.throughput / single.throughput if single else None,
                            prediction.bubble_fraction)
    if corrected is not None:
        result.in_situ = {"uncorrected_step_time_s": sim.step_time, "uncorrected_throughput": sim.throughput,
                          "uncorrected_bubble_fraction": sim.bubble_fraction, **situ_record}
    return result


def measure_steps(workload: Workload, balance: list[int], *, m: int, microbatch: int, checkpoint: str,
                  recompute_ahead: bool = False, schedule: str = "gpipe", threads: int | None = 1,
                  steps: int = 4, warmup: int = 2) -> tuple[list[float], dict[str, Any]]:
    """`steps` training steps of the cut on its real stage processes (after `warmup`): their
    seconds, and the host's conditions around them (:class:`HostWatch`)."""
    from gpipe_repro.distributed.measure import measure_pipeline

    with HostWatch() as watch:       # idle before, other processes' CPU during
        measured = measure_pipeline(functools.partial(workload.build, "cpu"), balance, m,
                                    workload.sample(m * microbatch), checkpoint=checkpoint,
                                    recompute_ahead=recompute_ahead, schedule=schedule,
                                    loss_fn=workload.loss_fn(), steps=steps, warmup=warmup,
                                    threads=threads or 1)
    return [float(t) for t in measured.step_times], watch.conditions


def attach_measurement(result: OwnModelResult, step_times: list[float], host: dict[str, Any]) -> None:
    """Record measured `step_times` (all of a configuration's, in whatever runs they were taken) on
    `result`: their median, and the simulator's error against it."""
    median = statistics.median(step_times)
    result.measured_step_time_s = median
    result.relative_error = median / result.step_time_s - 1.0
    result.measured_host = host
    result.measured_step_times_s = list(step_times)
    if result.in_situ is not None:
        uncorrected = result.in_situ["uncorrected_step_time_s"]
        result.in_situ["uncorrected_relative_error"] = median / uncorrected - 1.0
