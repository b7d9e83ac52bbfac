"""R replicas of a simulated pipeline: the data-parallel gradient all-reduce and its overlap.

What the runtime does (:mod:`gpipe_repro.distributed.data_parallel`): each stage s launches the
all-reduce of its gradients over its R replicas when its last backward of the step ends (time t_s in
the pipeline's timeline), and every rank waits for it at AGREE. So stage s's all-reduce is hidden
behind the drain of stages 0..s-1 as long as ``t_s + A_s`` is before the AGREE barrier would have been
released anyway; only what sticks out delays the step::

    release = max over s of max(arrival_s at AGREE, t_s + A_s)
    step    = pipeline step + (release - max over s of arrival_s)

and a step trains R x N examples. Replicas are independent pipelines running the same schedule on the
same costs, so one simulated pipeline stands for all of them. The runtime launches each bucket as
soon as its gradients are final, inside the last backward; the model launches the whole stage at the
end of that backward (one bucket), so it is conservative by up to one backward per stage.

**All-reduce cost** of n bytes over p ranks, alpha-beta model (alpha: latency per message, B:
bandwidth per rank per direction):

- ring: ``2 (p - 1) alpha + 2 (p - 1) / p * n / B`` (reduce-scatter then all-gather; bandwidth-optimal:
  Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC
  69(2), 2009);
- tree: ``2 ceil(log2 p) (alpha + n / B)`` (binomial-tree reduce then broadcast, unpipelined:
  Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH",
  IJHPCA 19(1), 2005). NCCL's pipelined double binary tree (Sanders, Speck & Traeff, Parallel
  Computing 35(12), 2009) is closer to the ring's bandwidth term; it is not modelled.

**Where the ranks are.** Ranks are laid out ``rank = replica * K + stage``
(:mod:`gpipe_repro.distributed.groups`) on hosts of G devices. If K >= G, every member of a
data-parallel group is on another host: the all-reduce runs over the inter-host link among R ranks.
If K < G, G / K replicas share a host: a hierarchical all-reduce (reduce-scatter inside the host over
NVLink, all-reduce of 1/h of the bytes between hosts, all-gather inside the host; as NCCL and
Horovod do). Every device of a host drives the host's network at once, so each gets 1/G of it.

**Links** (effective, approximate; sources beside the numbers):

- inside a host: the ``nvlink`` preset of :mod:`gpipe_repro.sim.links` (V100 NVLink 2.0, about
  100 GB/s between neighbours, 5 us; NVIDIA Tesla V100 whitepaper, 2017);
- between hosts: InfiniBand EDR, 100 Gbit/s = 12.5 GB/s per port per direction (InfiniBand Trade
  Association, EDR), four ports per eight-GPU host as in the DGX-1 (NVIDIA DGX-1 datasheet), so
  50 GB/s per host; 5 us per message (ConnectX-5 HCAs reach about 0.6 us; the rest is NCCL's and the
  switch's per-step overhead, an assumption, not a measurement).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.schedule import ActionKind
from gpipe_repro.sim.links import get_link
from gpipe_repro.sim.simulator import Simulation

__all__ = ["CollectiveLink", "INTRA_HOST", "INTER_HOST", "ALGORITHMS", "allreduce_time",
           "group_placement", "ReplicatedSimulation", "replicate"]

ALGORITHMS = ("ring", "tree")


@dataclass(frozen=True)
class CollectiveLink:
    """One link class for collectives: alpha (seconds per message) and bandwidth (bytes/s per rank
    per direction), with where the numbers come from."""
    name: str
    latency: float
    bandwidth: float
    source: str = ""


def _nvlink() -> CollectiveLink:
    link = get_link("nvlink")
    return CollectiveLink("nvlink", link.latency, link.bandwidth, link.source or "sim/links.py nvlink")


INTRA_HOST = _nvlink()
INTER_HOST_PER_HOST = CollectiveLink(
    "infiniband-edr-x4", 5e-6, 4 * 12.5e9,
    "InfiniBand EDR 100 Gbit/s = 12.5 GB/s per port per direction (IBTA); 4 ports per 8-GPU host "
    "(NVIDIA DGX-1 datasheet); 5 us per message assumed (HCA ~0.6 us + NCCL/switch overhead)")
INTER_HOST = INTER_HOST_PER_HOST


def flat_allreduce(nbytes: float, p: int, link: CollectiveLink, algorithm: str) -> float:
    """Seconds to all-reduce `nbytes` over `p` ranks on one link class (see the module docstring)."""
    require_one_of("algorithm", algorithm, ALGORITHMS)
    if p <= 1 or nbytes <= 0:
        return 0.0
    if algorithm == "ring":
        return 2 * (p - 1) * link.latency + 2 * (p - 1) / p * nbytes / link.bandwidth
    return 2 * math.ceil(math.log2(p)) * (link.latency + nbytes / link.bandwidth)


def group_placement(stages: int, replicas: int, devices_per_host: int) -> tuple[int, int]:
    """(members of one data-parallel group per host, hosts it spans) under rank = replica*K + stage."""
    if devices_per_host < 1:
        raise ValueError(f"devices_per_host must be >= 1, got {devices_per_host}")
    if stages >= devices_per_host:
        if stages % devices_per_host:
            raise ValueError(f"K={stages} is not a multiple of the {devices_per_host} devices of a "
                             "host: a pipeline spans whole hosts (K a multiple of the devices per "
                             "host), or whole pipelines share one (K divides them)")
        return 1, replicas
    if devices_per_host % stages:
        raise ValueError(f"K={stages} does not divide the {devices_per_host} devices of a host: whole "
                         "pipelines per host need K | devices per host (or K a multiple of it)")
    per_host = min(devices_per_host // stages, replicas)
    return per_host, math.ceil(replicas / per_host)


def allreduce_time(nbytes: float, *, stages: int, replicas: int, devices_per_host: int,
                   algorithm: str = "ring", intra: CollectiveLink = INTRA_HOST,
                   inter_per_host: CollectiveLink = INTER_HOST_PER_HOST) -> float:
    """Seconds for one stage's data-parallel all-reduce of `nbytes` (flat inside a host or between
    hosts, hierarchical when the group spans both; the inter-host bandwidth is shared by the host's
    devices)."""
    per_host, hosts = group_placement(stages, replicas, devices_per_host)
    inter = CollectiveLink(inter_per_host.name, inter_per_host.latency,
                           inter_per_host.bandwidth / devices_per_host, inter_per_host.source)
    if hosts == 1:
        return flat_allreduce(nbytes, per_host, intra, algorithm)
    if per_host == 1:
        return flat_allreduce(nbytes, hosts, inter, algorithm)
    h = per_host   # reduce-scatter and all-gather inside the host: each half of a ring all-reduce
    inside = (h - 1) * intra.latency + (h - 1) / h * nbytes / intra.bandwidth
    return 2 * inside + flat_allreduce(nbytes / h, hosts, inter, algorithm)


@dataclass
class ReplicatedSimulation:
    """One step of R replicas of a simulated pipeline (see the module docstring)."""
    pipeline: Simulation
    replicas: int
    allreduce: list[float]           # seconds per stage
    launched: list[float]            # when each stage's all-reduce starts (its last backward's end)
    step_time: float
    exposed: float                   # seconds the all-reduce adds to the pipeline's step
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def global_batch(self) -> int:
        """Examples per step over all replicas."""
        return self.pipeline.batch_size * self.replicas

    @property
    def throughput(self) -> float:
        """Samples per second of the whole job."""
        return self.global_batch / self.step_time

    def breakdown(self) -> dict[str, float]:
        """Fractions of the step: the pipeline's categories scaled to the longer step, plus the
        exposed all-reduce, and (not a fraction of the step) how much of the all-reduce was hidden."""
        scale = self.pipeline.step_time / self.step_time
        out = {k: v * scale for k, v in self.pipeline.breakdown.items()}
        out["data-parallel all-reduce (exposed)"] = self.exposed / self.step_time
        total = sum(self.allreduce)
        hidden = sum(min(a, max(0.0, self._arrival_max - t)) for a, t in zip(self.allreduce, self.launched))
        out["all-reduce hidden behind the drain (share of all-reduce time)"] = (hidden / total if total
                                                                                else 1.0)
        return out

    @property
    def _arrival_max(self) -> float:
        return float(self.meta["agree_release_s"])

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers."""
        return {"replicas": self.replicas, "global_batch": self.global_batch,
                "step_time_s": self.step_time, "throughput": self.throughput,
                "pipeline_step_time_s": self.pipeline.step_time, "allreduce_s": self.allreduce,
                "exposed_allreduce_s": self.exposed, "breakdown": self.breakdown(), **self.meta}


def replicate(sim: Simulation, stage_grad_bytes: Sequence[float], *, replicas: int,
              devices_per_host: int = 8, algorithm: str = "ring", intra: CollectiveLink = INTRA_HOST,
              inter_per_host: CollectiveLink = INTER_HOST_PER_HOST) -> ReplicatedSimulation:
    """R replicas of the simulated pipeline `sim` whose stage s holds `stage_grad_bytes[s]` bytes of
    gradients (4 x parameters in fp32)."""
    k = sim.timeline.num_stages
    if len(stage_grad_bytes) != k:
        raise ValueError(f"{len(stage_grad_bytes)} gradient sizes for {k} stages")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    backward = ActionKind.BACKWARD.value
    agree = ActionKind.AGREE.value
    launched, arrival = [0.0] * k, [0.0] * k
    for s in range(k):
        evs = sim.timeline.stage_events(s)
        launched[s] = max((e.end for e in evs if e.kind.startswith(backward)), default=0.0)
        arrival[s] = next(e.start for e in evs if e.kind == agree)
    times = [allreduce_time(b, stages=k, replicas=replicas, devices_per_host=devices_per_host,
                            algorithm=algorithm, intra=intra, inter_per_host=inter_per_host)
             for b in stage_grad_bytes]
    before = max(arrival)
    release = max(max(a, t + d) for a, t, d in zip(arrival, launched, times))
    exposed = release - before
    per_host, hosts = group_placement(k, replicas, devices_per_host)
    return ReplicatedSimulation(sim, replicas, times, launched, sim.step_time + exposed, exposed,
                                {"algorithm": algorithm, "devices_per_host": devices_per_host,
                                 "group_members_per_host": per_host, "group_hosts": hosts,
                                 "agree_release_s": before, "intra_link": intra.name,
                                 "inter_link": inter_per_host.name})
