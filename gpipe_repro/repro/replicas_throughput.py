"""`gpipe-repro throughput --k 8 --replicas 128 ...`: simulated samples/s of R pipeline replicas.

Per-layer costs are FLOPs on a device model (``--device p100 | tpu-v3-core``, deterministic, no
hardware needed; :mod:`gpipe_repro.sim.calibration`), the partition is the exact minimum-bottleneck
cut, one pipeline step is simulated (:mod:`gpipe_repro.sim.simulator`, the runtime's own schedule)
with the pipeline's boundary link (``--link``, default ``nvlink``: K stages inside a host), and the
data-parallel all-reduce and its overlap with the drain are added by
:func:`gpipe_repro.sim.data_parallel.replicate`. Everything printed is **simulated**.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.partition import partition
from gpipe_repro.sim.calibration import DEVICES, calibrate
from gpipe_repro.sim.data_parallel import ALGORITHMS, replicate
from gpipe_repro.sim.links import get_link
from gpipe_repro.sim.simulator import simulate_config

MODELS = ("transformer", "amoebanet")


def simulate_job(*, model: str, k: int, replicas: int, m: int, microbatch: int, device: str = "p100",
                 link: str = "nvlink", devices_per_host: int = 8, algorithm: str = "ring",
                 checkpoint: str = "always") -> dict[str, Any]:
    """One simulated step of K x R devices; returns the numbers :func:`main` prints."""
    from gpipe_repro.repro.throughput import PAPER_WORKLOADS

    require_one_of("model", model, MODELS)
    require_one_of("device", device, DEVICES)
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


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Parse the options, simulate, print (``--json`` for the numbers)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", choices=MODELS, default="transformer",
                   help="the paper's Transformer-48 or AmoebaNet-D (18, 256)")
    p.add_argument("--k", type=int, default=8, help="K: stages per pipeline")
    p.add_argument("--replicas", type=int, default=1, help="R: pipeline replicas (data parallel)")
    p.add_argument("--m", type=int, default=32, help="M: micro-batches per replica")
    p.add_argument("--microbatch", type=int, default=1, help="examples per micro-batch")
    p.add_argument("--device", default="p100", help=f"device model: {sorted(DEVICES)}")
    p.add_argument("--link", default="nvlink", help="the pipeline's boundary link (sim/links.py)")
    p.add_argument("--devices-per-host", type=int, default=8)
    p.add_argument("--algorithm", choices=ALGORITHMS, default="ring")
    p.add_argument("--checkpoint", default="always")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    a = p.parse_args(argv)
    try:
        out = simulate_job(model=a.model, k=a.k, replicas=a.replicas, m=a.m, microbatch=a.microbatch,
                           device=a.device, link=a.link, devices_per_host=a.devices_per_host,
                           algorithm=a.algorithm, checkpoint=a.checkpoint)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(out, indent=1, default=str) if a.json else format_job(out))
