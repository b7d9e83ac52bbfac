"""The pipeline simulator: a schedule, per-action costs and a link model in; a Timeline out.

Why simulate: the paper's Table 2 runs on 8 TPUs, Table 3 on 8 GPUs; this host has 2 cores. The
simulator answers "what would this configuration do on K devices" from costs measured (or counted)
per layer, with nothing invented in between:

- the order of actions is the schedule generator's (:func:`gpipe_repro.engine.schedule.make_schedule`), the
  very lists the runtimes execute, re-materialization and recompute-ahead included;
- the dataflow semantics are :func:`gpipe_repro.engine.interpreter.run_dataflow`'s, the one executor that
  ``Schedule.validate`` uses too (a stage runs its actions in order; a receive waits for its send;
  a link carries one message at a time);
- each action's duration is the sum of its cell's per-layer costs at that micro-batch's size
  (:mod:`gpipe_repro.sim.calibration`), plus the link model's per-message overheads for sends and
  receives (:mod:`gpipe_repro.sim.links`), and each transfer takes ``latency + bytes / bandwidth``;
- where the simulation is compared with this host's measured steps, each compute action's duration
  is drawn around its cost as durations vary in a pipeline here, and the figure is the median of
  the drawn steps (:mod:`gpipe_repro.sim.jitter`): the measured figure is a median step too.

It returns the same :class:`~gpipe_repro.engine.timeline.Timeline` the instrumented runtimes record, so a
simulation and a measurement are broken down (``Timeline.breakdown()``), charted and compared by
the same code.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpipe_repro.engine.interpreter import run_dataflow
from gpipe_repro.engine.microbatch import split_sizes
from gpipe_repro.engine.partition import check_balance
from gpipe_repro.engine.schedule import COMPUTE, Action, ActionKind, Schedule
from gpipe_repro.engine.timeline import Event, Timeline
from gpipe_repro.sim.calibration.costs import Calibration, LayerCost, split_input, split_weight
from gpipe_repro.sim.jitter import DRAWS, Jitter
from gpipe_repro.sim.links import LinkModel


@dataclass(frozen=True)
class PipelineCosts:
    """Seconds and bytes per action of each stage. Lists are indexed [stage][microbatch];
    ``boundary_bytes[s][m]`` is what stage s sends to s+1 (and ``grad_bytes`` what comes back)."""

    forward: Sequence[Sequence[float]]
    forward_nograd: Sequence[Sequence[float]]
    recompute: Sequence[Sequence[float]]
    backward: Sequence[Sequence[float]]
    optimizer: Sequence[float]
    boundary_bytes: Sequence[Sequence[float]]
    grad_bytes: Sequence[Sequence[float]]
    setup: float = 0.0     # seconds from the step's start to the first action (runtime's own cost)
    teardown: float = 0.0  # seconds from the last action to the step's end (e.g. loss broadcast)
    # The zero-bubble split: seconds of BACKWARD_INPUT per [stage][microbatch]; BACKWARD_WEIGHT gets
    # the rest of `backward`. None: half of `backward` (see calibration.costs.input_share).
    backward_input: Sequence[Sequence[float]] | None = None
    # Extra seconds per [stage][microbatch] of a backward that adds into existing parameter
    # gradients: every BACKWARD (or BACKWARD_WEIGHT) of a stage but its first in the step, which
    # writes fresh ones (`backward` is that first one's cost). None: no such cost (a FLOP model, or
    # costs replayed from a measured timeline, whose durations already hold it).
    accumulate: Sequence[Sequence[float]] | None = None
    # Seconds of BACKWARD_WEIGHT per [stage][microbatch] adding into existing gradients, as measured
    # (the split's two halves cost more than one backward: two graph walks and PyTorch's graph
    # analysis). None: the rest of `backward` after `backward_input`.
    backward_weight: Sequence[Sequence[float]] | None = None

    @property
    def num_stages(self) -> int:
        return len(self.forward)


def stage_costs(calibration: Calibration, balance: Sequence[int],
                microbatch_sizes: Sequence[int], setup: float = 0.0,
                teardown: float = 0.0) -> PipelineCosts:
    """Sum a calibration's per-layer costs over each cell of `balance`, per micro-batch size."""
    check_balance(balance, calibration.num_layers)
    firsts = [sum(balance[:s]) for s in range(len(balance))]
    cells: dict[int, list[list[LayerCost]]] = {}
    for size in set(microbatch_sizes):
        per_layer = calibration.at(size)
        cells[size] = [per_layer[f:f + n] for f, n in zip(firsts, balance)]

    def per_mb(attr: str) -> list[list[float]]:
        return [[sum(getattr(c, attr) for c in cells[b][s]) for b in microbatch_sizes]
                for s in range(len(balance))]

    any_size = microbatch_sizes[0]
    optimizer = [calibration.optimizer_call + sum(c.optimizer for c in cell) for cell in cells[any_size]]
    boundary = [[float(cells[b][s][-1].output_bytes) for b in microbatch_sizes]
                for s in range(len(balance) - 1)]
    grads = [[float(cells[b][s][-1].grad_bytes) for b in microbatch_sizes]
             for s in range(len(balance) - 1)]
    def split(half: Callable[[LayerCost], float]) -> list[list[float]]:
        return [[sum(half(c) for c in cells[b][s]) for b in microbatch_sizes] for s in range(len(balance))]

    return PipelineCosts(per_mb("forward"), per_mb("forward_nograd"), per_mb("recompute"),
                         per_mb("backward"), optimizer, boundary, grads, setup, teardown,
                         split(split_input), per_mb("accumulate"), split(split_weight))


@dataclass
class Simulation:
    """What one simulated training step gives."""

    timeline: Timeline
    batch_size: int
    step_time: float
    breakdown: dict[str, float] = field(default_factory=dict)
    utilization: list[float] = field(default_factory=list)
    exact_step_time: float | None = None   # drawn (jitter): the step with every action at its cost

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.batch_size / self.step_time

    @property
    def bubble_fraction(self) -> float:
        return self.breakdown.get("bubble", 0.0)

    def summary(self) -> dict[str, Any]:
        out = {"step_time_s": self.step_time, "throughput": self.throughput,
               "bubble_fraction": self.bubble_fraction, "utilization": self.utilization,
               "breakdown": self.breakdown}
        if self.exact_step_time is not None:
            out["exact_step_time_s"] = self.exact_step_time
        return out


def simulate(schedule: Schedule, costs: PipelineCosts, link: LinkModel, batch_size: int,
             jitter: Jitter | None = None, *, draws: int = DRAWS, seed: int = 0) -> Simulation:
    """Run `schedule` in virtual time with `costs` and `link`; one step of `batch_size` samples.

    With `jitter` (:mod:`gpipe_repro.sim.jitter`), every compute action's duration is its cost
    times a factor drawn for its length, `draws` steps are simulated (seeded: the same inputs give
    the same figure), and the step returned is the median one, with ``exact_step_time`` the step
    without jitter."""
    if jitter is None:
        return _simulate_once(schedule, costs, link, batch_size, None)
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    exact = _simulate_once(schedule, costs, link, batch_size, None)
    rng = random.Random(seed)
    runs = sorted((_simulate_once(schedule, costs, link, batch_size,
                                  lambda seconds: seconds * jitter.factor(seconds, rng))
                   for _ in range(draws)), key=lambda r: r.step_time)
    return replace(runs[(draws - 1) // 2], exact_step_time=exact.step_time)


def _simulate_once(schedule: Schedule, costs: PipelineCosts, link: LinkModel, batch_size: int,
                   vary: Callable[[float], float] | None) -> Simulation:
    k = schedule.num_stages
    if costs.num_stages != k:
        raise ValueError(f"costs are for {costs.num_stages} stages but the schedule has {k}")
    ckpt = [schedule.checkpointed(s) for s in range(k)]
    A = ActionKind
    # Each stage's first action writing parameter gradients: it writes fresh ones, later ones add.
    fresh = {next((a for a in actions if a.kind in (A.BACKWARD, A.BACKWARD_WEIGHT)), None)
             for actions in schedule.stages}

    def accumulating(a: Action) -> float:
        m = a.microbatch
        assert m is not None
        return 0.0 if costs.accumulate is None or a in fresh else costs.accumulate[a.stage][m]

    # One row per process: when stages share processes (interleaved, zb-v), a process's idle time is
    # what the bubble is, not each stage's; and a value between two stages of one process (zb-v's
    # chunks K-1 and K) is handed over in memory, not sent.
    row = schedule.process_of()

    def same_process(a: Action) -> bool:
        return row[a.stage] == row[a.peer().stage]

    def nbytes(a: Action) -> float:
        m = a.microbatch
        assert m is not None
        if a.kind in (A.SEND_ACT, A.RECV_ACT):
            return costs.boundary_bytes[a.stage if a.kind is A.SEND_ACT else a.stage - 1][m]
        return costs.grad_bytes[a.stage - 1 if a.kind is A.SEND_GRAD else a.stage][m]

    def duration(a: Action) -> float:
        s, m = a.stage, a.microbatch
        if a.kind is A.OPTIMIZER_STEP:
            return costs.optimizer[s]
        if a.kind is A.AGREE:  # the barrier's wait is the interpreter's; its all-reduce is ~tens of us
            return 0.0
        assert m is not None
        if a.kind is A.FORWARD:
            return (costs.forward_nograd if m in ckpt[s] else costs.forward)[s][m]
        if a.kind is A.RECOMPUTE:
            return costs.recompute[s][m]
        if a.kind is A.BACKWARD:
            return costs.backward[s][m] + accumulating(a)
        if a.kind in (A.BACKWARD_INPUT, A.BACKWARD_WEIGHT):
            # Stage 0 has no input gradient to send: its I does nothing, its W the whole backward
            # (StageExecutor._backward_input).
            i = 0.0 if s == 0 else (costs.backward_input[s][m] if costs.backward_input is not None
                                    else 0.5 * costs.backward[s][m])
            if a.kind is A.BACKWARD_INPUT:
                return i
            if s == 0 or costs.backward_weight is None:
                return costs.backward[s][m] - i + accumulating(a)
            # measured into existing gradients: the stage's first writes fresh ones
            fresh_saving = 0.0 if costs.accumulate is None else costs.accumulate[s][m]
            return costs.backward_weight[s][m] - fresh_saving + accumulating(a)
        if same_process(a):
            return 0.0
        if a.kind in (A.SEND_ACT, A.SEND_GRAD):
            return link.send_time(nbytes(a))
        return link.recv_time(nbytes(a))

    def transfer(a: Action) -> float:
        return 0.0 if same_process(a) else link.transfer_time(nbytes(a))

    def varied(a: Action) -> float:
        seconds = duration(a)
        return vary(seconds) if vary is not None and a.kind in COMPUTE else seconds

    sim_events = run_dataflow(schedule, varied, transfer)
    several = len(schedule.programs()) < schedule.num_stages      # processes run several cells
    send_start = {e.action.peer(): e.start for e in sim_events if e.action.kind in (A.SEND_ACT, A.SEND_GRAD)}
    shift = costs.setup
    events = []
    for e in sim_events:
        a = e.action
        ready = send_start[a] + shift if a.kind in (A.RECV_ACT, A.RECV_GRAD) else None
        events.append(Event(row[a.stage], a.kind.value, a.microbatch, e.start + shift, e.end + shift, ready,
                            cell=a.stage if several else None))
    timeline = Timeline(len(schedule.programs()), events, {"runtime": "simulator", "schedule": schedule.name,
                                                           "link": link.name, "batch_size": batch_size})
    step = timeline.makespan + costs.teardown
    return Simulation(timeline, batch_size, step, timeline.breakdown(), timeline.utilization())


def simulate_config(calibration: Calibration, balance: Sequence[int], num_microbatches: int,
                    batch_size: int, link: LinkModel, *, checkpoint: str = "except_last",
                    recompute_ahead: bool = False, schedule: str = "gpipe",
                    split_backwards: int | None = None, setup: float = 0.0, teardown: float = 0.0,
                    jitter: Jitter | None = None) -> Simulation:
    """One step of a (balance, M, N) configuration from per-layer calibrated costs. The defaults are
    :class:`gpipe_repro.GPipe`'s (re-materialize every micro-batch but the last, recompute after the
    gradient arrives), so a simulation with defaults is of a pipeline built with defaults."""
    from gpipe_repro.engine.schedule import make_schedule

    sizes = split_sizes(batch_size, num_microbatches)
    sched = make_schedule(schedule, len(balance), num_microbatches, checkpoint, recompute_ahead,
                          split_backwards)
    return simulate(sched, stage_costs(calibration, balance, sizes, setup, teardown), link, batch_size,
                    jitter)


def theoretical_bubble(num_stages: int, num_microbatches: int) -> float:
    """The paper's idle fraction of a balanced fill-drain pipeline: (K-1)/(M+K-1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def replay_costs(timeline: Timeline, step_time: float,
                 boundary_bytes: Sequence[float] = ()) -> PipelineCosts:
    """Per-action costs read off a measured timeline, to replay it through the simulator.

    Simulating a measured step with its own compute durations isolates the pipeline model (dataflow,
    links, runtime overheads) from the cost model: the difference between a replay and the
    measurement is what the simulator gets wrong about *how* actions interleave, whatever the
    machine's speed was at the time.
    """
    k = 1 + max(e.schedule_stage for e in timeline.events)   # cells: a process may run several
    m_count = 1 + max(e.microbatch for e in timeline.events if e.microbatch is not None)
    table: dict[str, list[list[float]]] = {kind: [[0.0] * m_count for _ in range(k)]
                                           for kind in ("forward", "recompute", "backward",
                                                        "backward_input", "backward_weight")}
    optimizer = [0.0] * k
    for e in timeline.events:
        if e.kind in table and e.microbatch is not None:
            table[e.kind][e.schedule_stage][e.microbatch] = e.duration
        elif e.kind == ActionKind.OPTIMIZER_STEP.value:
            optimizer[e.schedule_stage] = e.duration
    first = [timeline.stage_events(s)[0].start for s in range(timeline.num_stages)]
    sizes = list(boundary_bytes) or [0.0] * (k - 1)      # bytes crossing each boundary
    nbytes = [[float(sizes[s])] * m_count for s in range(k - 1)]
    backward = [[b + i + w for b, i, w in zip(*rows)] for rows in
                zip(table["backward"], table["backward_input"], table["backward_weight"])]
    return PipelineCosts(table["forward"], table["forward"], table["recompute"], backward,
                         optimizer, nbytes, nbytes, setup=min(first),
                         teardown=max(0.0, step_time - timeline.makespan),
                         backward_input=table["backward_input"])
