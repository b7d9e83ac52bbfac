"""Link models for the pipeline simulator: what it costs to move a boundary tensor between stages.

A pipeline sends one activation forward and one gradient back per micro-batch per boundary. Whether
that is free or the bottleneck depends only on the ratio of bytes to compute, so the simulator needs
the link as three numbers, the classic alpha-beta model plus the sender's own time:

- ``latency`` (alpha, seconds): from the end of a send to the first byte arriving;
- ``bandwidth`` (1/beta, bytes/s): the link carries one message at a time per direction, so a
  transfer occupies it for ``latency + bytes / bandwidth`` (queued transfers wait their turn);
- ``send_overhead`` / ``recv_overhead`` (seconds per message) and ``copy_bandwidth`` (bytes/s): CPU
  time the *stage itself* spends per message (posting the message, packing/unpacking). It delays the
  stage's next compute action, unlike latency, which only delays the receiver.

Presets, with where the numbers come from (all approximate, effective rather than peak):

- ``gloo-loopback``: this host's torch.distributed gloo backend over TCP on 127.0.0.1, **measured**
  by :func:`measure_gloo_loopback` (a ping-pong between pairs of processes; cached per host and torch
  version). This is the link the distributed runtime uses here, so it is the link of every measured
  cell and of the validation. The runtime's own costs come with it, measured on a pipeline of tiny
  layers (:func:`measure_runtime_overheads`): per message (posting a send, unpacking a receive)
  and per step (posting the receives before the first action; waiting for the sends and
  broadcasting the loss after the last).
- ``pcie``: GPUs without NVLink (the paper's Table 3, P100s on PCIe 3.0 x16: 15.75 GB/s peak per
  direction, about 10 GB/s achieved by device-to-device copies through the host bridge; about 10 us
  per transfer for the copy launch and synchronization). Sources: PCIe 3.0 specification; NVIDIA
  p2pBandwidthLatencyTest figures on P100 PCIe systems.
- ``nvlink``: NVLink between V100s (NVLink 2.0, 25 GB/s per link per direction, 6 links per GPU;
  about 100 GB/s achieved between two neighbours of a DGX-1 hybrid cube-mesh, about 5 us).
  Source: NVIDIA Tesla V100 whitepaper (2017).
- ``tpu-ici``: TPU inter-chip interconnect (TPUv2 496 Gbit/s, TPUv3 656 Gbit/s per link, i.e. 62-82
  GB/s; we take 70 GB/s and 2 us). Source: Jouppi et al., "A domain-specific supercomputer for
  training deep neural networks", CACM 63(7), 2020.
- ``ideal``: zero cost; the simulator then shows the pure schedule (bubble and imbalance only).
"""
from __future__ import annotations

import json
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gpipe_repro.report.records import atomic_write

PING_SIZES = (4, 4096, 65536, 1 << 20, 8 << 20)   # bytes per ping-pong message
PING_ROUNDS = 3                                     # fresh pairs of processes


@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta link plus per-message stage overheads (see the module docstring)."""

    name: str
    latency: float                       # seconds
    bandwidth: float                     # bytes per second
    send_overhead: float = 0.0           # seconds the sending stage is busy per message
    recv_overhead: float = 0.0           # seconds the receiving stage is busy per message
    copy_bandwidth: float | None = None  # bytes/s the stages pack/unpack at (None: free)
    source: str = ""

    def transfer_time(self, nbytes: float) -> float:
        """Time a message occupies the link, from the end of the send to its arrival."""
        if nbytes <= 0 and self.latency == 0.0:
            return 0.0
        return self.latency + nbytes / self.bandwidth

    def send_time(self, nbytes: float) -> float:
        """Time the sending stage is busy with a message (not the transfer itself)."""
        return self.send_overhead + (nbytes / self.copy_bandwidth if self.copy_bandwidth else 0.0)

    def recv_time(self, nbytes: float) -> float:
        """Time the receiving stage is busy with a message once it has arrived."""
        return self.recv_overhead + (nbytes / self.copy_bandwidth if self.copy_bandwidth else 0.0)

    def with_overheads(self, send: float, recv: float) -> LinkModel:
        return replace(self, send_overhead=send, recv_overhead=recv)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LinkModel:
        return cls(**data)


PRESETS: dict[str, LinkModel] = {
    "ideal": LinkModel("ideal", 0.0, float("inf"), source="no communication cost"),
    "pcie": LinkModel("pcie", 10e-6, 10e9,
                      source="PCIe 3.0 x16 without NVLink (P100, Table 3): ~10 GB/s, ~10 us"),
    "nvlink": LinkModel("nvlink", 5e-6, 100e9,
                        source="NVLink 2.0 between V100 neighbours: ~100 GB/s, ~5 us"),
    "tpu-ici": LinkModel("tpu-ici", 2e-6, 70e9,
                         source="TPUv2/v3 inter-chip interconnect: 62-82 GB/s per link, ~2 us "
                                "(Jouppi et al. 2020)"),
}
LINK_NAMES = (*PRESETS, "gloo-loopback")


def get_link(name: str, *, refresh: bool = False) -> LinkModel:
    """A preset by name; ``gloo-loopback`` is measured on this host (cached)."""
    if name == "gloo-loopback":
        return measure_gloo_loopback(refresh=refresh)
    if name not in PRESETS:
        raise ValueError(f"unknown link {name!r}; choose one of {', '.join(LINK_NAMES)}")
    return PRESETS[name]


# ----------------------------------------------------------------------------- gloo ping-pong

def fit_alpha_beta(sizes: list[int], one_way: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``t = latency + bytes / bandwidth``; returns (latency, bandwidth)."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(one_way) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes, one_way))
    slope = max(sxy / sxx, 1e-15)
    latency = max(my - slope * mx, min(one_way))
    # The intercept of a fit dominated by large messages is noisy: the smallest message's one-way
    # time is the honest latency when it is the smaller of the two.
    latency = min(latency, one_way[sizes.index(min(sizes))])
    return latency, 1.0 / slope


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping_pong_worker(rank: int, port: int, sizes: tuple[int, ...], repeats: int,
                      out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        bufs = {nbytes: torch.zeros(max(1, nbytes // 4), dtype=torch.float32) for nbytes in sizes}
        times: dict[int, list[float]] = {nbytes: [] for nbytes in sizes}
        # Every repeat goes through all sizes, so a host whose speed drifts moves them alike.
        for i in range(repeats + 3):
            for nbytes, buf in bufs.items():
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if i >= 3:
                    times[nbytes].append(time.perf_counter() - t0)
        if rank == 0:
            out.put({nbytes: statistics.median(t) / 2 for nbytes, t in times.items()})
    finally:
        dist.destroy_process_group()


def ping_pong(sizes: tuple[int, ...] = PING_SIZES, repeats: int = 20) -> dict[int, float]:
    """One-way seconds per message size between two fresh gloo processes on this host."""
    from gpipe_repro.distributed.launcher import preloaded_forkserver

    ctx = preloaded_forkserver()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ping_pong_worker, args=(r, port, sizes, repeats, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
    return {int(k): float(v) for k, v in result.items()}


def measure_gloo_loopback(*, refresh: bool = False, cache: Path | None = None) -> LinkModel:
    """This host's gloo loopback link, measured by ping-pong between several pairs of processes and
    cached on disk."""
    import torch

    from gpipe_repro.sim.cache import cache_dir

    key = f"gloo-loopback-{socket.gethostname()}-torch{torch.__version__}-{PING_ROUNDS}x.json"
    path = cache or cache_dir() / "links" / key
    if path.exists() and not refresh:
        return LinkModel.from_json(json.loads(path.read_text())["link"])
    # One pair of processes is a sample of where the host put them (its latency ranged 84-197 us
    # between pairs): the median per size over several pairs.
    rounds = [ping_pong() for _ in range(PING_ROUNDS)]
    sizes = sorted(rounds[0])
    one_way = {size: statistics.median(r[size] for r in rounds) for size in sizes}
    latency, bandwidth = fit_alpha_beta(sizes, [one_way[s] for s in sizes])
    link = LinkModel("gloo-loopback", latency, bandwidth,
                     source=f"measured on {socket.gethostname()} by gloo ping-pong "
                            f"({len(sizes)} sizes, {min(sizes)} B to {max(sizes) >> 20} MiB; the "
                            f"median of {PING_ROUNDS} pairs of processes)")
    with atomic_write(path) as f:
        json.dump({"link": link.to_json(), "one_way_s": one_way}, f, indent=2)
    return link


# ----------------------------------------------------------------------------- runtime overheads

@dataclass(frozen=True)
class RuntimeOverheads:
    """What the distributed runtime itself costs per step and per message on this host, measured on
    a pipeline of tiny layers (so that nothing but the runtime takes time)."""

    setup: float      # seconds from a step's start to its first action (posting receives, ...)
    teardown: float   # from the last action to the step's end (waiting for sends, loss broadcast)
    send: float       # stage seconds of one SEND (posting a non-blocking send)
    recv: float       # stage seconds of one RECV whose bytes have already arrived
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _tiny_layers() -> list[Any]:
    from torch import nn

    return [nn.Linear(4, 4) for _ in range(4)]


OVERHEAD_ROUNDS = 5   # fresh pairs of stage processes
OVERHEAD_STEPS = 20   # measured steps in each


def overheads_from_timeline(timeline: Any, step_time: float, latency: float) -> RuntimeOverheads:
    """Read the runtime's overheads off one measured step of a pipeline whose compute is negligible."""
    first = [timeline.stage_events(s)[0].start for s in range(timeline.num_stages)]
    sends = [e.duration for e in timeline.events if e.kind.startswith("send")]
    # A receive that began well after its send started found its bytes there: pure processing.
    settled = [e.duration for e in timeline.events if e.kind.startswith("recv")
               and e.ready is not None and e.start >= e.ready + 2 * latency]
    if not settled:
        settled = [e.end - max(e.start, e.ready or e.start) for e in timeline.events
                   if e.kind.startswith("recv")]
        settled = [max(0.0, d - latency) for d in settled]
    return RuntimeOverheads(setup=statistics.median(first),
                            teardown=max(0.0, step_time - timeline.makespan),
                            send=statistics.median(sends) if sends else 0.0,
                            recv=statistics.median(settled) if settled else 0.0)


def overheads_from_steps(timelines: Sequence[Any], step_times: Sequence[float],
                         latency: float) -> RuntimeOverheads:
    """The runtime's overheads over many measured steps: each read off its own step
    (:func:`overheads_from_timeline`), then the median of each over the steps. One step alone is
    a sample of this host's speed states: its setup ranged 0.5-4.2 ms between measurements, which
    moved the simulated throughput table's cells by up to 4.4% with the same layer costs."""
    if not timelines or len(timelines) != len(step_times):
        raise ValueError(f"need one step time per timeline, got {len(timelines)} timelines and "
                         f"{len(step_times)} step times")
    steps = [overheads_from_timeline(t, s, latency) for t, s in zip(timelines, step_times)]
    return RuntimeOverheads(*(statistics.median(getattr(o, name) for o in steps)
                              for name in ("setup", "teardown", "send", "recv")))


def measure_runtime_overheads(*, refresh: bool = False, cache: Path | None = None) -> RuntimeOverheads:
    """The distributed runtime's per-step and per-message overheads on this host (cached)."""
    import torch

    from gpipe_repro.distributed.measure import measure_pipeline
    from gpipe_repro.sim.cache import cache_dir

    rounds, steps = OVERHEAD_ROUNDS, OVERHEAD_STEPS
    key = f"runtime-overheads-{socket.gethostname()}-torch{torch.__version__}-{rounds}x{steps}.json"
    path = cache or cache_dir() / "links" / key
    if path.exists() and not refresh:
        return RuntimeOverheads(**json.loads(path.read_text()))
    link = measure_gloo_loopback()
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 4, generator=g), torch.randint(0, 4, (8,), generator=g))
    timelines: list[Any] = []
    step_times: list[float] = []
    for _ in range(rounds):
        m = measure_pipeline(_tiny_layers, [2, 2], 8, batch, checkpoint="never", steps=steps,
                             warmup=3)
        timelines += m.timelines
        step_times += m.step_times
    found = overheads_from_steps(timelines, step_times, link.latency)
    result = RuntimeOverheads(found.setup, found.teardown, found.send, found.recv,
                              source=f"measured on {socket.gethostname()}: 2 stage processes, 4 "
                                     f"Linear(4, 4) layers, M=8; each overhead the median over "
                                     f"{rounds} runs of {steps} steps, read off every step")
    with atomic_write(path) as f:
        json.dump(result.to_json(), f, indent=2)
    return result
