"""calibrate(): per-layer costs of a workload at each micro-batch size, cached on disk."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine import boundary, cpu_allocator
from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.engine.layer_costs import activation_bytes, layer_flop_counts
from gpipe_repro.models.workload import Workload
from gpipe_repro.report.provenance import cpu_model
from gpipe_repro.sim.cache import cache_dir
from gpipe_repro.sim.calibration.costs import Calibration, LayerCost
from gpipe_repro.sim.calibration.neighbours import busy_neighbours
from gpipe_repro.sim.calibration.shapes import (
    materialize,
    materialize_value,
    trace_shapes,
    trace_signatures,
)
from gpipe_repro.sim.calibration.timing import (
    ActionSeconds,
    optimizer_call_overhead,
    time_layer_actions,
    time_model_actions,
)
from gpipe_repro.sim.devices import DEVICES, DeviceModel

METHODS = ("time", "flops")
UNCERTAINTY_TARGET = 0.005
"""The relative half-width of a layer's interval at which extra calibration rounds stop."""
# Bump when what a calibration measures changes, so cached timings are not reused across the change.
CALIBRATION_VERSION = 7


def device_description(device: torch.device | str, threads: int, neighbours: int = 0) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    busy = f", {neighbours} busy neighbour core{'s' if neighbours != 1 else ''}" if neighbours else ""
    return f"cpu: {cpu_model()}, {threads} thread{'s' if threads != 1 else ''}{busy}"


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of the source of the code whose cost a calibration times (the engine: the stage
    executor, DeferredBatchNorm, the RNG seeding) and of the calibration itself."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha1()
    for path in sorted([*(root / "engine").glob("*.py"), *Path(__file__).parent.glob("*.py")]):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _cache_file(workload: Workload, method: str, device_desc: str, size: int, repeats: int,
                rounds: int | tuple[int, int, float] = 1, in_sequence: bool = False) -> Path:
    host = platform.node() if method == "time" else ""
    code = code_digest() if method == "time" else ""
    allocator = cpu_allocator.describe() if method == "time" and device_desc.startswith("cpu") else ""
    key = json.dumps([CALIBRATION_VERSION, workload.key(), method, device_desc, size,
                      torch.__version__, repeats, rounds, host, code, allocator, in_sequence])
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{workload.family}-{method}-b{size}-{digest}.json"


def calibrate(workload: Workload, sizes: Sequence[int], *, method: str = "time",
              device: torch.device | str = "cpu", device_model: DeviceModel | None = None,
              threads: int | None = 1, repeats: int = 20, use_cache: bool = True,
              neighbours: int = 0, rounds: int = 1, in_sequence: bool | None = None,
              max_rounds: int | None = None, tolerance: float = UNCERTAINTY_TARGET,
              progress: Callable[[str], None] | None = None) -> Calibration:
    """Per-layer costs of `workload` at each micro-batch size in `sizes` (see the module docstring).

    method="time" measures on `device` with `threads` torch threads (None: leave as is), with
    `neighbours` other cores busy training the same model (CPU only; see :func:`busy_neighbours`);
    method="flops" counts FLOPs and converts them with `device_model` (default: "nominal").
    `rounds` > 1 times every layer that many times, interleaved across layers, and keeps the median
    round (robust to a burst of load during one layer's timing); the cache is keyed by it too.
    `max_rounds` (default `rounds`): more interleaved rounds, up to this many, while the median
    layer's 95% interval over rounds (:func:`gpipe_repro.report.measurement.median_interval`) is
    wider than `tolerance` (relative half-width; 0.5%: two calibrations then agree within about 1%
    per layer); that half-width is recorded as the calibration's uncertainty
    (:meth:`Calibration.uncertainty_at`), which the partition choice uses to break near-ties.
    `in_sequence` (method="time"): True times every layer of the whole model in the order a stage
    runs them (:func:`time_model_actions`: the caches as in a pipeline stage); False times one layer
    of each group of identical layers alone (:func:`time_layer_actions`: any model size, but a layer
    alone keeps its weights in the caches and looks up to a third cheaper at small micro-batches);
    None: in sequence where the whole model fits in half the device's free memory
    (:func:`fits_in_sequence`).

    Several sizes to time are timed in interleaved rounds: the first half of each size's least
    rounds in the order given, then the rest in reverse order, so that a host whose speed drifts
    over the calibration moves every size's costs alike: their ratios are what a speedup over one
    device at the whole mini-batch is, and a normalized cell of the fixed-mini-batch table (each M
    at its own micro-batch size).

    Cached per (workload and its shapes, micro-batch size, method, device and thread count, host,
    the source of the code whose cost is timed, torch version, repeats, rounds): a calibration is
    reused only where it would measure the same thing again.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    max_rounds = rounds if max_rounds is None else max_rounds
    if max_rounds < rounds:
        raise ValueError(f"max_rounds ({max_rounds}) must be >= rounds ({rounds})")
    if tolerance <= 0:
        raise ValueError(f"tolerance must be > 0 (a relative half-width), got {tolerance}")
    schedule = (rounds, max_rounds, tolerance)
    require_one_of("calibration method", method, METHODS)
    device = torch.device(device)
    if method == "time" and device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no GPU: use --device cpu")
    previous_threads = torch.get_num_threads()
    if method == "time" and threads is not None and device.type == "cpu":
        torch.set_num_threads(threads)
    if method == "time" and device.type == "cpu":
        cpu_allocator.keep_freed_memory()     # as the stage processes run (process-wide, for good)
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
        to_time: list[tuple[int, Path, bool]] = []
        for size in sizes:
            whole = method == "time" and (fits_in_sequence(workload, layers, size, device)
                                          if in_sequence is None else in_sequence)
            path = _cache_file(workload, method, desc, size, repeats,
                               rounds if max_rounds == rounds else schedule, whole)
            if not (use_cache and path.exists()):
                to_time.append((size, path, whole))
                continue
            if progress:
                progress(f"calibrating {workload.name} at micro-batch {size} ({method}, cached)")
            cached = Calibration.from_json(json.loads(path.read_text()))
            calib = calib or Calibration(workload.name, method, desc, cached.groups,
                                         optimizer_call=cached.optimizer_call)
            calib.costs[size] = cached.costs[size]
            calib.uncertainty.update(cached.uncertainty)

        def timed(size: int, whole: bool, plan: tuple[int, int, float],
                  timings: dict[int, list[Any]]) -> Calibration:
            if progress:
                progress(f"calibrating {workload.name} at micro-batch {size} ({method})")
            with busy_neighbours(workload, size, neighbours if method == "time" else 0):
                return _calibrate_size(workload, layers, size, method, device, device_model,
                                       repeats, plan, whole, reuse_counts=use_cache, timings=timings)
        # Several sizes timed: their first rounds in order, the rest in reverse order (see the
        # docstring).
        timings: dict[int, dict[int, list[Any]]] = {size: {} for size, _, _ in to_time}
        first = rounds // 2 if method == "time" and len(to_time) > 1 else 0
        if first:
            for size, _, whole in to_time:
                timed(size, whole, (first, first, tolerance), timings[size])
        for size, path, whole in (reversed(to_time) if first else to_time):
            one = timed(size, whole, schedule, timings[size])
            one.device = desc
            _write_cache(path, one)
            calib = calib or Calibration(workload.name, method, desc, one.groups,
                                         optimizer_call=one.optimizer_call)
            calib.costs[size] = one.costs[size]
            calib.uncertainty.update(one.uncertainty)
        assert calib is not None, "no micro-batch sizes given"
        return calib
    finally:
        torch.set_num_threads(previous_threads)


def _write_cache(path: Path, calib: Calibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(calib.to_json()))
    os.replace(tmp, path)


# What a calibration derives from the model's structure alone, kept for the rest of the process:
# (forward, forward + backward) FLOPs by the layer's signature (the one its group is made of: same
# type, modules, parameter shapes, input and output) and the modes of its modules; the meta trace
# (inputs, outputs, groups, signatures) by (workload key, micro-batch size), the key the disk cache of
# FLOP calibrations trusts. Both run every op through Python dispatch on meta tensors (the counting
# through FlopCounterMode too), the bulk of a small model's calibration, and a run that calibrates one
# workload at one size by time and then by FLOPs (gpu-check, the throughput table) would trace and
# count the same layers again. Written by every calibration, read only by those allowed to reuse what
# was computed before (use_cache=True). Signatures are kept as hashes (a paper-size layer's repr is long).
_FLOP_COUNTS: dict[str, tuple[int, int]] = {}
_TRACES: dict[tuple[str, int], tuple[list[Any], list[Any], list[int], list[str]]] = {}


def _flop_counts(layer: nn.Module, x: Any, signature: str, reuse: bool) -> tuple[int, int]:
    modes = "".join("t" if m.training else "e" for m in layer.modules())
    key = hashlib.sha1(f"{signature}|{modes}".encode()).hexdigest()
    if not reuse or key not in _FLOP_COUNTS:
        _FLOP_COUNTS[key] = layer_flop_counts(layer, x)
    return _FLOP_COUNTS[key]


def _calibrate_size(workload: Workload, layers: list[nn.Module], size: int, method: str,
                    device: torch.device, device_model: DeviceModel | None,
                    repeats: int, rounds: int | tuple[int, int, float] = 1,
                    in_sequence: bool = False, *,
                    reuse_counts: bool = True,
                    timings: dict[int, list[ActionSeconds]] | None = None) -> Calibration:
    """One size's costs from rounds of timings; `timings` (filled in place): rounds already timed,
    which the rounds asked for continue."""
    inputs, target = workload.sample(size, "cpu")
    trace_key = (workload.key(), size)
    if not reuse_counts or trace_key not in _TRACES:
        if len(_TRACES) >= 64:
            _TRACES.clear()
        traced_ins, traced_outs, traced_groups, sigs = trace_signatures(layers, inputs)
        _TRACES[trace_key] = (traced_ins, traced_outs, traced_groups,
                              [hashlib.sha1(sig.encode()).hexdigest() for sig in sigs])
    ins, outs, groups, signatures = _TRACES[trace_key]
    call = optimizer_call_overhead(device) if method == "time" else 0.0
    last = len(layers) - 1
    # The layers to measure: one per group of identical layers, plus the first and the last (they
    # differ in what they run: no input gradient, the loss).
    timed: list[int] = []
    seen: set[int] = set()
    for i, g in enumerate(groups):
        if g not in seen or i in (0, last):
            timed.append(i)
            if i not in (0, last):
                seen.add(g)
    timings = {} if timings is None else timings
    for i in timed:
        timings.setdefault(i, [])
    least, most, tolerance = rounds if isinstance(rounds, tuple) else (rounds, rounds, UNCERTAINTY_TARGET)
    if method == "time" and in_sequence:
        whole_loss = (workload.loss_fn(), target.to(device))
        while _more_rounds(timings, least, most, tolerance):
            reals = [materialize(layer, device) for layer in layers]
            for i, t in enumerate(time_model_actions(reals, inputs, device, loss=whole_loss,
                                                     repeats=repeats)):
                timings.setdefault(i, []).append(t)
            del reals
    elif method == "time":
        # Rounds interleaved across layers: a burst of load on the host lands in one round of a
        # few layers, and the median over rounds drops it.
        while _more_rounds(timings, least, most, tolerance):
            for i in timed:
                real = materialize(layers[i], device)
                x_real = boundary.to_device(inputs, device) if i == 0 else materialize_value(ins[i], device)
                loss = (workload.loss_fn(), target.to(device)) if i == last else None
                timings[i].append(time_layer_actions(real, x_real, device, index=i, first=i == 0,
                                                     loss=loss, repeats=repeats))
                del real, x_real
    per_layer: dict[int, LayerCost] = {}
    split: list[float | None]
    for i in timed:
        layer, x, y = layers[i], ins[i], outs[i]
        fwd_flops, flops = _flop_counts(layer, x, signatures[i], reuse_counts)
        params = sum(p.numel() for p in layer.parameters())
        if method == "flops":
            assert device_model is not None
            f = fwd_flops / device_model.flop_rate
            b = (flops - fwd_flops) / device_model.flop_rate
            o = 16 * params / device_model.memory_bandwidth
            timing = (f, f, f, b, o)
            accumulate, split = 0.0, [None, None]
        else:
            f, fng, r, b, o, accumulate, *split = _medians(timings[i])
            timing = (f, fng, r, b, max(0.0, o - call))
        per_layer[i] = LayerCost(*timing, accumulate=accumulate, backward_input=split[0],
                                 backward_weight=split[1],
                                 forward_flops=float(fwd_flops), flops=float(flops),
                                 params=params, output_bytes=activation_bytes(y),
                                 grad_bytes=sum(t.numel() * t.element_size()
                                                for t in boundary.tensors(y) if t.is_floating_point()))
    representative = {groups[i]: per_layer[i] for i in timed if i not in (0, last)}
    costs = [per_layer[i] if i in per_layer else representative[g] for i, g in enumerate(groups)]
    if in_sequence and method == "time":
        # Every layer was timed where it sits; identical layers (one group, the first and the last
        # apart: they run different actions) get their pooled median: the differences between them
        # are noise, and pooling both steadies the cost and keeps the partitioner's ties between
        # identical layers broken the same way on every run. FLOPs come per group either way.
        members: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            if i not in (0, last):
                members.setdefault(g, []).append(i)
        pooled = {g: [row for i in ids for row in timings[i]] for g, ids in members.items()}
        costs = [c if i in (0, last) else _with_timing(c, pooled[groups[i]], call)
                 for i, c in enumerate(costs)]
    uncertainty = {size: _uncertainty(timings, shares=True)} if method == "time" else {}
    return Calibration(workload.name, method, "", groups, {size: costs}, call, uncertainty)


def _uncertainty(timings: dict[int, list[ActionSeconds]], *, shares: bool = False) -> float:
    """The median layer's relative half-width of a seeded percentile bootstrap of the median of
    its per-round cost (forward, checkpointed forward, recompute, backward,
    accumulation); 0.0 with fewer than 3 rounds (unknown). With `shares`, of its share of the round's
    total instead: a host that runs a whole round slower moves every cost alike, which changes no
    cut, so what the partition choice must allow for is the spread of the shares."""
    from gpipe_repro.report.measurement import bootstrap_median_interval

    rows = {i: [t[0] + t[1] + t[2] + t[3] + t[5] for t in r] for i, r in timings.items() if r}
    count = min((len(r) for r in rows.values()), default=0)
    if count < 3:
        return 0.0
    if shares:
        totals = [sum(r[k] for r in rows.values()) for k in range(count)]
        rows = {i: [r[k] / totals[k] for k in range(count)] for i, r in rows.items()}
    widths = []
    for values in rows.values():
        mid = statistics.median(values[:count])
        low, high = bootstrap_median_interval(values[:count])
        if mid > 0:
            widths.append((high - low) / 2 / mid)
    return statistics.median(widths) if widths else 0.0


def _more_rounds(timings: dict[int, list[ActionSeconds]], least: int, most: int,
                 tolerance: float) -> bool:
    """Whether to time another round: fewer than `least` so far, or fewer than `most` and the
    costs' uncertainty still above `tolerance`."""
    done = min((len(rows) for rows in timings.values()), default=0)
    return done < least or (done < most and _uncertainty(timings) > tolerance)


def _medians(rounds: Sequence[ActionSeconds]) -> list[Any]:
    """Each value's median over calibration rounds (None where a round has None: no split)."""
    return [None if any(v is None for v in col) else statistics.median(col) for col in zip(*rounds)]


def _with_timing(cost: LayerCost, rounds: Sequence[ActionSeconds], call: float) -> LayerCost:
    """`cost` (a group's representative) with timings from `rounds` (their medians)."""
    f, fng, r, b, o, accumulate, b_in, b_w = _medians(rounds)
    return dataclasses.replace(cost, forward=f, forward_nograd=fng, recompute=r, backward=b,
                               optimizer=max(0.0, o - call), accumulate=accumulate,
                               backward_input=b_in, backward_weight=b_w)


def fits_in_sequence(workload: Workload, layers: list[nn.Module], size: int,
                     device: torch.device) -> bool:
    """Whether the whole model, trained at micro-batch `size` with an optimizer, fits in half of the
    free memory of `device` (parameters and gradients twice over, plus four times every layer's
    output for what autograd keeps): then :func:`calibrate` times it in sequence."""
    param_bytes = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    inputs, _ = workload.sample(size, "cpu")
    _, outs, _ = trace_shapes(layers, inputs)
    need = 4 * param_bytes + 4 * sum(activation_bytes(y) for y in outs)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return need <= free // 2
