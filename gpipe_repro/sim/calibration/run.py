"""calibrate(): per-layer costs of a workload at each micro-batch size, cached on disk."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from gpipe_repro.engine import boundary
from gpipe_repro.engine.layer_costs import activation_bytes, layer_flops
from gpipe_repro.models.workload import Workload
from gpipe_repro.report.provenance import cpu_model
from gpipe_repro.sim.cache import cache_dir
from gpipe_repro.sim.calibration.costs import Calibration, LayerCost
from gpipe_repro.sim.calibration.neighbours import busy_neighbours
from gpipe_repro.sim.calibration.shapes import materialize, materialize_value, trace_shapes
from gpipe_repro.sim.calibration.timing import forward_flops, optimizer_call_overhead, time_layer_actions
from gpipe_repro.sim.devices import DEVICES, DeviceModel

METHODS = ("time", "flops")
# Bump when what a calibration measures changes, so cached timings are not reused across the change.
CALIBRATION_VERSION = 5


def device_description(device: torch.device | str, threads: int, neighbours: int = 0) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    busy = f", {neighbours} busy neighbour core{'s' if neighbours != 1 else ''}" if neighbours else ""
    return f"cpu: {cpu_model()}, {threads} thread{'s' if threads != 1 else ''}{busy}"


def _cache_file(workload: Workload, method: str, device_desc: str, size: int, repeats: int) -> Path:
    key = json.dumps([CALIBRATION_VERSION, workload.key(), method, device_desc, size,
                      torch.__version__, repeats])
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{workload.family}-{method}-b{size}-{digest}.json"


def calibrate(workload: Workload, sizes: Sequence[int], *, method: str = "time",
              device: torch.device | str = "cpu", device_model: DeviceModel | None = None,
              threads: int | None = 1, repeats: int = 20, use_cache: bool = True,
              neighbours: int = 0,
              progress: Callable[[str], None] | None = None) -> Calibration:
    """Per-layer costs of `workload` at each micro-batch size in `sizes` (see the module docstring).

    method="time" measures on `device` with `threads` torch threads (None: leave as is), with
    `neighbours` other cores busy training the same model (CPU only; see :func:`busy_neighbours`);
    method="flops" counts FLOPs and converts them with `device_model` (default: "nominal").
    """
    if method not in METHODS:
        raise ValueError(f"calibration method must be one of {METHODS}, got {method!r}")
    device = torch.device(device)
    if method == "time" and device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no GPU: use --device cpu")
    previous_threads = torch.get_num_threads()
    if method == "time" and threads is not None and device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        used_threads = torch.get_num_threads()
        if method == "flops":
            device_model = device_model or DEVICES["nominal"]
            desc = f"flops: {device_model.name}"
        else:
            neighbours = neighbours if device.type == "cpu" else 0
            desc = device_description(device, used_threads, neighbours)
        layers = workload.build("meta")
        calib: Calibration | None = None
        for size in sizes:
            path = _cache_file(workload, method, desc, size, repeats)
            cached_now = use_cache and path.exists()
            if progress:
                progress(f"calibrating {workload.name} at micro-batch {size} ({method}"
                         f"{', cached' if cached_now else ''})")
            if cached_now:
                cached = Calibration.from_json(json.loads(path.read_text()))
                calib = calib or Calibration(workload.name, method, desc, cached.groups,
                                             optimizer_call=cached.optimizer_call)
                calib.costs[size] = cached.costs[size]
                continue
            with busy_neighbours(workload, size, neighbours if method == "time" else 0):
                one = _calibrate_size(workload, layers, size, method, device, device_model,
                                      repeats)
            one.device = desc
            _write_cache(path, one)
            calib = calib or Calibration(workload.name, method, desc, one.groups,
                                         optimizer_call=one.optimizer_call)
            calib.costs[size] = one.costs[size]
        assert calib is not None, "no micro-batch sizes given"
        return calib
    finally:
        torch.set_num_threads(previous_threads)


def _write_cache(path: Path, calib: Calibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(calib.to_json()))
    os.replace(tmp, path)


def _calibrate_size(workload: Workload, layers: list[nn.Module], size: int, method: str,
                    device: torch.device, device_model: DeviceModel | None,
                    repeats: int) -> Calibration:
    inputs, target = workload.sample(size, "cpu")
    ins, outs, groups = trace_shapes(layers, inputs)
    call = optimizer_call_overhead(device) if method == "time" else 0.0
    last = len(layers) - 1
    per_group: dict[int, LayerCost] = {}
    costs = []
    for i, (layer, x, y, g) in enumerate(zip(layers, ins, outs, groups)):
        if g not in per_group or i in (0, last):  # the first/last layer differ in what they run
            flops = layer_flops(layer, x)
            fwd_flops = forward_flops(layer, x)
            params = sum(p.numel() for p in layer.parameters())
            if method == "flops":
                assert device_model is not None
                f = fwd_flops / device_model.flop_rate
                b = (flops - fwd_flops) / device_model.flop_rate
                o = 16 * params / device_model.memory_bandwidth
                timing = (f, f, f, b, o)
            else:
                real = materialize(layer, device)
                x_real = boundary.to_device(inputs, device) if i == 0 else materialize_value(x, device)
                loss = (workload.loss_fn(), target.to(device)) if i == last else None
                f, fng, r, b, o = time_layer_actions(real, x_real, device, index=i, first=i == 0,
                                                     loss=loss, repeats=repeats)
                timing = (f, fng, r, b, max(0.0, o - call))
                del real, x_real
            cost = LayerCost(*timing, forward_flops=float(fwd_flops), flops=float(flops),
                             params=params, output_bytes=activation_bytes(y),
                             grad_bytes=sum(t.numel() * t.element_size() for t in boundary.tensors(y)
                                            if t.is_floating_point()))
            if i not in (0, last):
                per_group[g] = cost
        else:
            cost = per_group[g]
        costs.append(cost)
    return Calibration(workload.name, method, "", groups, {size: costs}, call)
