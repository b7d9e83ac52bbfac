"""`gpipe-repro throughput --k 8 --replicas 128 ...`: simulated samples/s of R pipeline replicas.

Per-layer costs are FLOPs on a device model (``--device p100 | tpu-v3-core``, deterministic, no
hardware needed; :mod:`gpipe_repro.sim.calibration`), the partition is the exact minimum-bottleneck
cut, one pipeline step is simulated (:mod:`gpipe_repro.sim.simulator`, the runtime's own schedule)
with the pipeline's boundary link (``--link``, default ``nvlink``: K stages inside a host), and the
data-parallel all-reduce and its overlap with the drain are added by
:func:`gpipe_repro.sim.data_parallel.replicate`. Everything printed is **simulated**.
"""
from __future__ import annotations

from typing import Any

from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.partition import partition
from gpipe_repro.sim.calibration import DEVICES, calibrate
from gpipe_repro.sim.data_parallel import replicate
from gpipe_repro.sim.links import get_link
from gpipe_repro.sim.simulator import simulate_config

MODELS = ("transformer", "amoebanet")
COMMAND = "throughput --replicas"


def simulate_job(*, model: str, k: int, replicas: int, m: int, microbatch: int, device: str = "p100",
                 link: str = "nvlink", devices_per_host: int = 8, algorithm: str = "ring",
                 checkpoint: str = "always") -> dict[str, Any]:
    """One simulated step of K x R devices: the numbers :func:`format_job` prints."""
    from gpipe_repro.repro.throughput import PAPER_WORKLOADS

    require_one_of("--model", model, MODELS)      # this command's options (throughput --replicas)
    require_one_of("--device", device, [d for d in DEVICES if d != "nominal"])
    if min(k, replicas, m, microbatch, devices_per_host) < 1:
        raise ValueError("--k, --replicas, --m, --microbatch and --devices-per-host must be >= 1")
    workload = PAPER_WORKLOADS[model]
    calib = calibrate(workload, [microbatch], method="flops", device_model=DEVICES[device])
    layer_costs = calib.partition_costs(microbatch, checkpoint)
    if k > len(layer_costs):
        raise ValueError(f"--k {k} is more than the {len(layer_costs)} layers of {workload.name}")
    balance = partition(layer_costs, k, "bottleneck")
    sim = simulate_config(calib, balance, m, m * microbatch, get_link(link), checkpoint=checkpoint)
    per_layer = calib.at(microbatch)
    firsts = [sum(balance[:s]) for s in range(k)]
    grad_bytes = [4.0 * sum(c.params for c in per_layer[f:f + n]) for f, n in zip(firsts, balance)]
    rep = replicate(sim, grad_bytes, replicas=replicas, devices_per_host=devices_per_host,
                    algorithm=algorithm)
    return {"method": "simulated", "model": workload.name, "device": DEVICES[device].source,
            "pipeline_link": link, "K": k, "R": replicas, "devices": k * replicas, "M": m,
            "microbatch": microbatch, "balance": balance, "stage_grad_bytes": grad_bytes,
            **rep.summary()}


def format_job(out: dict[str, Any]) -> str:
    """The printed report."""
    lines = [f"{out['model']}: K={out['K']} x R={out['R']} = {out['devices']} devices, M={out['M']}, "
             f"micro-batch {out['microbatch']}, global batch {out['global_batch']} (simulated)",
             f"  device: {out['device']}",
             f"  all-reduce: {out['algorithm']}, group of {out['R']} = {out['group_members_per_host']} per "
             f"host x {out['group_hosts']} hosts ({out['intra_link']} / {out['inter_link']})",
             f"  samples/s: {out['throughput']:.1f}   step: {out['step_time_s'] * 1e3:.2f} ms "
             f"(pipeline {out['pipeline_step_time_s'] * 1e3:.2f} ms + exposed all-reduce "
             f"{out['exposed_allreduce_s'] * 1e3:.2f} ms)",
             "  all-reduce per stage (ms): " + " ".join(f"{a * 1e3:.2f}" for a in out["allreduce_s"]),
             "  time breakdown:"]
    lines += [f"    {k:<62} {v:7.1%}" for k, v in out["breakdown"].items()]
    return "\n".join(lines)
