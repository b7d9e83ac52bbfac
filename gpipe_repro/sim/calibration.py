"""Per-layer costs of a model at each micro-batch size: the simulator's and the partitioner's input.

Why per micro-batch size: a layer's cost per sample is not constant. On one CPU thread a matmul-heavy
layer costs 1.6x more per sample at batch 32 than at 256 (2.3x at 16); on a GPU small batches leave
the device idle. A simulation of M micro-batches must use costs measured at the size those
micro-batches actually have, or it reports speedups no pipeline can reach.

Why measure each *distinct* layer once: a Transformer-48 is 48 copies of one layer shape, an
AmoebaNet a dozen distinct cells. Layers with the same type, module structure, parameter and buffer
shapes, input signature and output signature cost the same, so one is timed and the result shared;
a 48-layer Transformer costs one layer's profiling. To get there without allocating the model, the
model is built on the ``meta`` device, the sample's shapes are propagated through it (free), and
only one representative per group is materialized on the real device (re-initialized: timing does
not depend on the values).

Two sources, as in :mod:`gpipe_repro.engine.layer_costs`:

- ``time``: seconds measured on ``cpu`` or ``cuda`` (trimmed mean of repeats, see
  :func:`robust_seconds`), for each action the schedule runs: FORWARD keeping the graph,
  checkpointed FORWARD (``no_grad``), RECOMPUTE, BACKWARD, and the OPTIMIZER_STEP (committing the
  BatchNorm statistics, updating the parameters). Each forward includes the engine's per-layer RNG
  seeding and BatchNorm is the engine's DeferredBatchNorm, so the costs are those of the stage
  executor. The last layer includes the loss. Measured in the conditions of a running pipeline:
  the thread count the runtime uses (1 per stage process on a CPU host) and, on a CPU, the other
  cores busy training the same model (:func:`busy_neighbours`).
- ``flops``: forward and backward FLOPs (``torch.utils.flop_counter`` on meta tensors: deterministic,
  device-free, seconds even for paper-size models), turned into seconds by a :class:`DeviceModel`.

Timings are cached on disk (``$GPIPE_REPRO_CACHE`` or ``~/.cache/gpipe-repro``), one JSON file per
(workload, device and thread count, micro-batch size, torch version, repeats, calibration version),
so a rerun of an experiment costs nothing and a change of any of those re-measures.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gpipe_repro.engine import boundary
from gpipe_repro.engine.batchnorm import DeferredBatchNorm, commit_all
from gpipe_repro.engine.layer_costs import activation_bytes, layer_flops
from gpipe_repro.engine.recompute import recomputing
from gpipe_repro.engine.rng import seed_layer

METHODS = ("time", "flops")
# Bump when what a calibration measures changes, so cached timings are not reused across the change.
CALIBRATION_VERSION = 5


def cache_dir() -> Path:
    """Where calibrations and link measurements are cached."""
    root = os.environ.get("GPIPE_REPRO_CACHE") or Path.home() / ".cache" / "gpipe-repro"
    return Path(root)


# ----------------------------------------------------------------------------- workloads

@dataclass(frozen=True)
class Workload:
    """A model of the registry (:mod:`gpipe_repro.models`) and its inputs, described as data so a
    calibration can be cached by it and rebuilt in another process."""

    name: str                         # a label for tables ("AmoebaNet-D (18, 32), 32x32")
    family: str                       # "amoebanet-d", "transformer-lm", ...
    options: tuple[tuple[str, Any], ...]   # builder keywords, as sorted pairs (hashable)
    kind: str                         # "image" (float images, class targets) or "tokens" (LM)
    input_shape: tuple[int, ...]      # per example: (C, H, W) or (T,)
    classes: int                      # class count or vocabulary size (targets are drawn below it)

    @classmethod
    def create(cls, name: str, family: str, kind: str, input_shape: Sequence[int], classes: int,
               **options: Any) -> Workload:
        if kind not in ("image", "tokens"):
            raise ValueError(f"workload kind must be 'image' or 'tokens', got {kind!r}")
        return cls(name, family, tuple(sorted(options.items())), kind, tuple(input_shape), classes)

    def key(self) -> str:
        """A stable identifier of everything that determines the costs."""
        text = json.dumps([self.family, self.options, self.kind, self.input_shape, self.classes])
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def build(self, device: torch.device | str = "cpu", seed: int = 0) -> list[nn.Module]:
        """The model's layers (on ``meta`` nothing is allocated)."""
        from gpipe_repro.models import build

        torch.manual_seed(seed)
        with torch.device(device):
            return list(build(self.family, **dict(self.options)))

    def sample(self, batch: int, device: torch.device | str = "cpu",
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A synthetic (inputs, targets) batch of `batch` examples."""
        g = torch.Generator().manual_seed(seed)
        if self.kind == "image":
            x = torch.randn((batch, *self.input_shape), generator=g)
            y = torch.randint(0, self.classes, (batch,), generator=g)
        else:
            x = torch.randint(0, self.classes, (batch, *self.input_shape), generator=g)
            y = torch.randint(0, self.classes, (batch, *self.input_shape), generator=g)
        return x.to(device), y.to(device)

    def loss_fn(self) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        if self.kind == "image":
            from gpipe_repro.models.amoebanet import amoebanet_loss
            return amoebanet_loss
        from gpipe_repro.models.transformer_lm import lm_loss
        return lm_loss


# ----------------------------------------------------------------------------- devices for FLOP costs

@dataclass(frozen=True)
class DeviceModel:
    """Turns FLOPs into seconds for the deterministic ``flops`` costs: ``flops / flop_rate`` for
    compute, ``16 bytes x parameters / memory_bandwidth`` for an optimizer step (read weight,
    gradient and one slot, write two). Optimistic for memory-bound layers (pooling, BatchNorm)."""

    name: str
    flop_rate: float          # achieved FLOP/s
    memory_bandwidth: float   # bytes/s
    source: str = ""


DEVICES: dict[str, DeviceModel] = {
    # Half of peak is what large convolutions and matmuls typically reach in training.
    "p100": DeviceModel("p100", 0.5 * 9.3e12, 732e9,
                        "NVIDIA P100 PCIe: 9.3 TFLOP/s fp32 peak (50% assumed), 732 GB/s HBM2"),
    "tpu-v3-core": DeviceModel("tpu-v3-core", 0.5 * 61.5e12, 450e9,
                               "one TPUv3 core: 61.5 TFLOP/s bf16 peak (50% assumed), ~450 GB/s"),
    # A fixed nominal rate: the CI regression uses it so its numbers never depend on the host.
    "nominal": DeviceModel("nominal", 1e10, 1e10, "nominal 10 GFLOP/s, 10 GB/s (CI, deterministic)"),
}


# ----------------------------------------------------------------------------- costs

@dataclass(frozen=True)
class LayerCost:
    """What one layer costs on one micro-batch of a given size (seconds, FLOPs, bytes)."""

    forward: float           # FORWARD that keeps its graph (a non-checkpointed micro-batch)
    forward_nograd: float    # FORWARD of a checkpointed micro-batch (no_grad)
    recompute: float         # RECOMPUTE (graph rebuilt, BatchNorm statistics not accumulated)
    backward: float
    optimizer: float         # the OPTIMIZER_STEP's extra seconds for this layer: committing its
                             # BatchNorm statistics and updating its parameters (beyond the fixed
                             # cost of the optimizer call, Calibration.optimizer_call)
    forward_flops: float
    flops: float             # forward + backward
    params: int
    output_bytes: int        # the layer's output: what crosses a boundary cut after it
    grad_bytes: int          # the floating part of the output: what its gradient sends back


@dataclass
class Calibration:
    """Per-layer costs of one workload at several micro-batch sizes on one device."""

    workload: str
    method: str                           # "time" or "flops"
    device: str                           # "cpu: <model>, 1 thread", "cuda: H100", "flops: p100"
    groups: list[int]                     # per layer: index of its group of identical layers
    costs: dict[int, list[LayerCost]] = field(default_factory=dict)   # size -> per-layer costs
    optimizer_call: float = 0.0           # fixed seconds of one optimizer step call, once per cell

    @property
    def num_layers(self) -> int:
        return len(self.groups)

    def at(self, size: int) -> list[LayerCost]:
        if size not in self.costs:
            raise KeyError(f"no calibration at micro-batch size {size} (have {sorted(self.costs)}); "
                           "calibrate at every micro-batch size the configuration uses")
        return self.costs[size]

    def partition_costs(self, size: int, checkpoint: str = "always") -> list[float]:
        """Per-layer cost the partitioner balances: the seconds of the actions one micro-batch runs
        through the layer (checkpointed forward + recompute + backward under re-materialization,
        forward + backward without)."""
        if checkpoint == "never":
            return [c.forward + c.backward for c in self.at(size)]
        return [c.forward_nograd + c.recompute + c.backward for c in self.at(size)]

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.workload, "method": self.method, "device": self.device,
                "groups": self.groups, "optimizer_call": self.optimizer_call,
                "costs": {str(b): [asdict(c) for c in cs] for b, cs in self.costs.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        return cls(data["workload"], data["method"], data["device"], list(data["groups"]),
                   {int(b): [LayerCost(**c) for c in cs] for b, cs in data["costs"].items()},
                   float(data.get("optimizer_call", 0.0)))


# ----------------------------------------------------------------------------- shapes on meta

def value_signature(value: Any) -> Any:
    """Shapes and dtypes of the tensors in a boundary value (plain values as themselves)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (tuple, list)):
        return tuple(value_signature(v) for v in value)
    return ("plain", repr(value))


def layer_signature(layer: nn.Module, x: Any, y: Any) -> str:
    """Two layers with the same signature cost the same (see the module docstring)."""
    structure = tuple(type(m).__qualname__ for m in layer.modules())
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in layer.named_buffers())
    return repr((structure, params, buffers, value_signature(x), value_signature(y)))


def trace_shapes(layers: Sequence[nn.Module], sample: Any) -> tuple[list[Any], list[Any], list[int]]:
    """Each layer's (meta) input and output, and its group of identical layers.

    `layers` may live on any device; they are copied to ``meta`` one at a time, so tracing a model of
    any size costs no memory and almost no time.
    """
    x = boundary.map_tensors(sample, lambda t: t.to("meta"))
    inputs, outputs, groups, seen = [], [], [], {}
    with torch.no_grad():
        for layer in layers:
            meta = copy.deepcopy(layer).to("meta").train()
            y = meta(x)
            sig = layer_signature(meta, x, y)
            groups.append(seen.setdefault(sig, len(seen)))
            inputs.append(x)
            outputs.append(y)
            x = y
    return inputs, outputs, groups


def materialize(layer: nn.Module, device: torch.device | str) -> nn.Module:
    """A copy of `layer` with real, freshly initialized storage on `device` (works from ``meta``)."""
    real = copy.deepcopy(layer).to_empty(device=device)
    with torch.no_grad():
        for p in real.parameters():
            p.normal_(0.0, 0.02)
        for b in real.buffers():
            b.zero_()
        for m in real.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
    return real


def materialize_value(value: Any, device: torch.device | str, seed: int = 0) -> Any:
    """Real tensors shaped like a meta value: floats random normal, integers 0, bools True."""
    g = torch.Generator().manual_seed(seed)

    def make(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:
            return torch.randn(t.shape, generator=g, dtype=t.dtype).to(device)
        if t.dtype == torch.bool:
            return torch.ones(t.shape, dtype=torch.bool, device=device)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)

    return boundary.map_tensors(value, make)


# ----------------------------------------------------------------------------- timing

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def robust_seconds(samples: Sequence[float]) -> float:
    """The mean of repeated timings, trimmed of the fastest and slowest fifth.

    A mean because costs add up: a cell's expected time is the sum of its layers' expected times,
    jitter included (a low quantile of short timings misses the interruptions a long action cannot
    avoid). Trimmed so that a rare pause (a page fault, the garbage collector, a neighbour on the
    host) does not move a cost measured from a few dozen repeats.
    """
    ordered = sorted(samples)
    cut = len(ordered) // 5
    return statistics.fmean(ordered[cut:len(ordered) - cut] if len(ordered) > 2 * cut else ordered)


def time_layer_actions(layer: nn.Module, x: Any, device: torch.device | str, *, index: int = 0,
                       first: bool = False, loss: tuple[Callable[..., torch.Tensor], Any] | None = None,
                       repeats: int = 20, warmup: int = 2) -> tuple[float, float, float, float, float]:
    """Seconds of (forward, checkpointed forward, recompute, backward, optimizer step) of a copy of
    `layer` as the stage executor runs it (see the module docstring), by :func:`robust_seconds`.

    Unlike :func:`gpipe_repro.engine.layer_costs.measure_layer` (forward + backward only) it times every action the
    schedule has, leaves the first layer's input without a gradient (the runtime does not
    differentiate the data), and adds `loss` = (loss_fn, target) on the last layer.
    """
    device = torch.device(device)
    layer = DeferredBatchNorm.convert(copy.deepcopy(layer)).to(device).train()
    params = [p for p in layer.parameters() if p.requires_grad]
    opt = make_optimizer(params) if params else None

    def run(inp: Any) -> Any:
        seed_layer(0, 0, index, 0, device)
        y = layer(inp)
        return loss[0](y, loss[1]) if loss is not None else y

    def backward(y: Any) -> None:
        outs = [t for t in boundary.tensors(y) if t.is_floating_point() and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, None if loss is not None else
                                    [torch.ones_like(t) for t in outs])

    def stamp() -> float:
        _sync(device)
        return time.perf_counter()

    samples: list[tuple[float, ...]] = []
    for i in range(warmup + repeats):
        inp = boundary.to_device(x, device) if first else boundary.attach(x, device)
        t0 = stamp()
        with torch.no_grad():
            run(inp)                      # a checkpointed FORWARD
        t1 = stamp()
        y = run(inp)                      # a FORWARD that keeps its graph
        t2 = stamp()
        del y
        with recomputing():
            y = run(inp)                  # a RECOMPUTE
        t3 = stamp()
        backward(y)
        t4 = stamp()
        commit_all(layer)                 # the OPTIMIZER_STEP commits DeferredBatchNorm statistics
        if opt is not None:
            opt.step()
        t5 = stamp()
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        if i >= warmup:
            samples.append((t2 - t1, t1 - t0, t3 - t2, t4 - t3, t5 - t4))
    f, fng, r, b, o = (robust_seconds(col) for col in zip(*samples))
    return f, fng, r, b, o


def make_optimizer(params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer whose step the calibration times: plain SGD, the measured runs' default
    (:func:`gpipe_repro.distributed.measure.sgd`)."""
    return torch.optim.SGD(params, lr=0.01)


def optimizer_call_overhead(device: torch.device | str = "cpu", repeats: int = 50) -> float:
    """Seconds of one optimizer step on a single scalar parameter: the fixed cost of a call, which a
    cell pays once however many layers it holds."""
    p = nn.Parameter(torch.zeros(1, device=device))
    opt = make_optimizer([p])
    samples = []
    for _ in range(repeats + 5):
        p.grad = torch.ones_like(p)
        t0 = time.perf_counter()
        opt.step()
        _sync(torch.device(device))
        samples.append(time.perf_counter() - t0)
    return robust_seconds(samples[5:])


def forward_flops(layer: nn.Module, x: Any) -> int:
    """Forward FLOPs of `layer` on `x` (meta tensors are fine)."""
    layer = copy.deepcopy(layer)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        layer(x)
    return counter.get_total_flops()


# ----------------------------------------------------------------------------- busy neighbours

def _busy_loop(workload: Workload, size: int, stop: Any, ready: Any) -> None:
    """Train `workload` on micro-batches of `size` until `stop` is set (a pipeline's other stage)."""
    torch.set_num_threads(1)
    model = nn.Sequential(*[DeferredBatchNorm.convert(layer) for layer in workload.build("cpu")])
    x, y = workload.sample(size)
    loss_fn = workload.loss_fn()
    first = True
    while not stop.is_set():
        loss_fn(model(x), y).backward()
        model.zero_grad(set_to_none=True)
        if first:
            ready.put(True)
            first = False


@contextlib.contextmanager
def busy_neighbours(workload: Workload, size: int, count: int) -> Iterator[None]:
    """Keep `count` other cores busy training the same model while the body runs.

    Why: the stages of a pipeline compute at the same time, and cores that share caches, memory
    bandwidth (or, in a VM, a physical core) slow each other down; a layer timed on an otherwise idle
    host runs faster than it does inside a running pipeline (5-15% on this project's 2-core host).
    Timing with the neighbouring cores busy measures the cost in the pipeline's steady state.
    """
    if count <= 0:
        yield
        return
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_busy_loop, args=(workload, size, stop, ready), daemon=True)
             for _ in range(count)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=300)
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


# ----------------------------------------------------------------------------- calibrate

def device_description(device: torch.device | str, threads: int, neighbours: int = 0) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    from gpipe_repro.report.provenance import cpu_model
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
