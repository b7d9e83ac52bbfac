"""Choosing K, R and M for N devices: R replicas of a K-stage pipeline, K x R = N.

For every K that divides N (powers of two up to the layers), R = N / K, and every (M, checkpoint)
of :func:`gpipe_repro.memory.autoplan.evaluate` (memory-capped cut, exact memory plan, simulated
pipeline step), the data-parallel all-reduce of each stage's gradients and its overlap with the drain
are added by :func:`gpipe_repro.sim.data_parallel.replicate`. The answer is the fitting configuration
with the highest simulated samples/s of the whole job; the runner-ups and the reason are kept.

Decisions:

- **weak scaling**: the planner's mini-batch is each replica's; the job trains R x N examples per
  step (the paper's "replicate this pipeline 8 times"). Comparing K's at a fixed global batch would
  need one memory planner per replica batch;
- **memory**: the runtime's gradient buckets are a flat copy of the stage's gradients, kept for the
  whole run (the summed gradients are views of them: :mod:`gpipe_repro.distributed.data_parallel`),
  so with R > 1 each stage's peak is counted as its planned peak plus its gradient bytes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpipe_repro.engine.schedule import make_schedule
from gpipe_repro.memory.autoplan import Candidate, evaluate, micro_batch_candidates, simulate_step
from gpipe_repro.memory.planner import MemoryPlanner
from gpipe_repro.sim.data_parallel import ReplicatedSimulation, replicate
from gpipe_repro.sim.links import LinkModel

__all__ = ["ReplicaCandidate", "plan_replicas"]


@dataclass
class ReplicaCandidate:
    """One (K, R, M, checkpoint) for N devices."""
    pipeline: Candidate
    replicas: int
    fits: bool
    peak_with_buckets: int = 0
    throughput: float = 0.0            # samples/s of the whole job (simulated)
    exposed_allreduce: float = 0.0     # seconds per step
    result: ReplicatedSimulation | None = None

    @property
    def partitions(self) -> int:
        """K."""
        return self.pipeline.partitions

    def why(self) -> str:
        """A one-line account of where the step's time goes."""
        if not self.fits:
            return self.pipeline.note or "does not fit"
        r = self.result
        assert r is not None
        return (f"bubble {self.pipeline.bubble:.0%}, all-reduce {max(r.allreduce) * 1e3:.1f} ms per stage, "
                f"{self.exposed_allreduce * 1e3:.1f} ms of it exposed")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready numbers."""
        return {"K": self.partitions, "R": self.replicas, "M": self.pipeline.micro_batches,
                "checkpoint": self.pipeline.checkpoint, "balance": self.pipeline.balance,
                "fits": self.fits, "peak_bytes": self.peak_with_buckets,
                "throughput": self.throughput, "exposed_allreduce_s": self.exposed_allreduce,
                "why": self.why()}


def check_whole_hosts(devices: int, devices_per_host: int,
                      names: tuple[str, str] = ("devices", "devices_per_host")) -> None:
    """Raise ValueError unless `devices` fill whole hosts of `devices_per_host` (or fit in one),
    naming the two as `names` say (a command's options)."""
    if devices > devices_per_host and devices % devices_per_host:
        d, h = names
        raise ValueError(f"{d} {devices} at {h} {devices_per_host} is not a whole number of hosts: "
                         f"give {d} a multiple of {devices_per_host}, or {h} a divisor of {devices}")


def plan_replicas(planner: MemoryPlanner, devices: int, budget: float, link: LinkModel,
                  flops_per_second: float, *, micro_batches: Sequence[int] | None = None,
                  checkpoints: Sequence[str] = ("except_last", "never"), devices_per_host: int = 8,
                  algorithm: str = "ring", schedule: str = "gpipe",
                  left_out: dict[int, str] | None = None) -> list[ReplicaCandidate]:
    """Every (K, R = devices / K, M, checkpoint) candidate, the fastest fitting one first (the M
    candidates: :func:`~gpipe_repro.memory.autoplan.micro_batch_candidates`)."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    check_whole_hosts(devices, devices_per_host)
    # every K that divides the devices and lays pipelines on hosts whole (K divides a host's
    # devices, or is a multiple of them: sim.data_parallel.group_placement), not powers of two only
    devices_per_host = min(devices_per_host, devices)    # fewer devices than a host holds: one host
    ks = [k for k in range(1, min(devices, planner.num_layers) + 1) if devices % k == 0
          and (devices_per_host % k == 0 or k % devices_per_host == 0)]
    ms = micro_batch_candidates(planner, micro_batches, left_out)
    out = []
    for k in ks:
        r = devices // k
        for m in ms:
            for c in checkpoints:
                cand = evaluate(planner, k, m, c, budget, link, flops_per_second, schedule)
                out.append(_replicate(planner, cand, r, budget, link, flops_per_second,
                                      devices_per_host, algorithm, schedule))
    return sorted(out, key=lambda c: (not c.fits, -c.throughput, c.peak_with_buckets))


def _replicate(planner: MemoryPlanner, cand: Candidate, replicas: int, budget: float, link: LinkModel,
               flops_per_second: float, devices_per_host: int, algorithm: str,
               schedule: str) -> ReplicaCandidate:
    if not cand.fits or cand.plan is None:
        return ReplicaCandidate(cand, replicas, False, cand.max_peak)
    profs = planner.profiles(planner.sizes(cand.micro_batches)[0], flops=True)
    starts = [sum(cand.balance[:s]) for s in range(len(cand.balance))]
    grad_bytes = [float(sum(p.param_bytes for p in profs[a:a + n])) for a, n in zip(starts, cand.balance)]
    peak = cand.max_peak + (int(max(grad_bytes)) if replicas > 1 else 0)
    if peak > budget:
        return ReplicaCandidate(cand, replicas, False, peak)
    sched = make_schedule(schedule, cand.partitions, cand.micro_batches, cand.checkpoint)
    sim = simulate_step(planner, sched, cand.balance, cand.micro_batches, flops_per_second, link)
    rep = replicate(sim, grad_bytes, replicas=replicas, devices_per_host=devices_per_host,
                    algorithm=algorithm)
    return ReplicaCandidate(cand, replicas, True, peak, rep.throughput, rep.exposed, rep)
