"""Part 1: the engine on the device equals plain PyTorch, parameter by parameter.

One small model that has everything the engine must get right: dropout (masks replayed by
re-materialization), BatchNorm (per-micro-batch normalization, running statistics committed once per
mini-batch) and tuple boundaries (a float tensor, an integer tensor and a plain value cross cells).
Each case trains one step with ``GPipe`` and with :func:`reference_step`, then compares the loss,
every parameter's gradient, every updated parameter, and the BatchNorm running statistics. Cases:
K = 1..4 cells on the device (cuts forced onto the tuple boundaries), every checkpoint mode, fp32 and
bf16 autocast; K = 2 on the mixed list ``["cpu", device]``; and ``pipe.to(device)`` after building the
pipeline on the CPU; K = 2 on the mixed list with the targets left on the CPU (the inputs are always
given on the CPU: the engine moves them to the first cell; elsewhere the targets are given on the
last cell's device, so that one placement rule cannot mask every other result).

The reference is independent of the engine: it imports nothing from ``gpipe_repro``. It splits the
batch as ``torch.tensor_split`` does, runs the layers one micro-batch at a time with plain autograd,
seeds the default generators before each layer as docs/design.md specifies ("randomness is a
function of (seed, step, layer, micro-batch)", splitmix64 as in Steele, Lea and Flood, "Fast
splittable pseudorandom number generators", OOPSLA 2014), weights micro-batch m's loss by n_m / N,
updates with SGD by hand (w - lr * g), and computes the running statistics BatchNorm must end with
directly from the whole mini-batch (mean and unbiased variance of every input the layer saw).
"""
from __future__ import annotations

import contextlib
import copy
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_repro.repro.gpu_check import _deps

CHECKPOINTS = ("always", "except_last", "never")
LR = 0.1
_MASK64 = (1 << 64) - 1
# Balances putting a cut on the tuple boundaries (after layers 2 and 3) of the 10-layer model.
BALANCES = {1: [10], 2: [3, 7], 3: [3, 1, 6], 4: [3, 1, 3, 3]}
Triple = tuple[torch.Tensor, torch.Tensor, int]


# ----------------------------------------------------------------------------- the model

class ToTuple(nn.Module):
    """x -> (relu(x), a long mask, a plain int): a tuple boundary with every kind of leaf."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        return torch.relu(x), (x > 0).long(), 2


class TupleLinear(nn.Module):
    """(h, mask, k) -> (linear(h) * k + mask, mask, k): consumes and produces a tuple."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, value: Triple) -> Triple:
        h, mask, k = value
        return self.linear(h) * k + mask.to(h.dtype), mask, k


class FromTuple(nn.Module):
    """(h, mask, k) -> h masked: back to one tensor."""

    def forward(self, value: Triple) -> torch.Tensor:
        h, mask, _ = value
        return h * (1 + mask.to(h.dtype)) / 2


def check_model(width: int, seed: int = 0) -> list[nn.Module]:
    """The 10 layers every case trains (see the module docstring)."""
    torch.manual_seed(seed)
    return [nn.Linear(width, width), nn.Dropout(0.25), ToTuple(), TupleLinear(width), FromTuple(),
            nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width), nn.Dropout(0.1),
            nn.Linear(width, 3)]


# ----------------------------------------------------------------------------- the reference

def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def reference_seed(seed: int, step: int, layer: int, microbatch: int) -> int:
    """The seed the design gives layer `layer` on micro-batch `microbatch` (63 bits)."""
    h = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    h = _splitmix64(h ^ (layer & _MASK64))
    h = _splitmix64(h ^ (microbatch & _MASK64))
    return h & ((1 << 63) - 1)


def _tensor_split_sizes(n: int, m: int) -> list[int]:
    return [n // m + (1 if i < n % m else 0) for i in range(m)]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


def reference_step(layers: Sequence[nn.Module], devices: Sequence[torch.device], x: torch.Tensor,
                   y: torch.Tensor, *, micro_batches: int, seed: int = 0, step: int = 0,
                   lr: float = LR) -> float:
    """One training step of `layers` (layer i on devices[i]) in plain PyTorch; returns the loss.

    Leaves ``.grad`` of every parameter holding the mini-batch gradient, the parameters updated by
    SGD, and each BatchNorm's running statistics as one forward over the whole mini-batch leaves them.
    """
    params = [p for layer in layers for p in layer.parameters()]
    for p in params:
        p.grad = None
    seen: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.register_forward_pre_hook(
        lambda mod, args, i=i: seen.setdefault(i, []).append(args[0].detach().float()))
        for i, layer in enumerate(layers) if isinstance(layer, nn.modules.batchnorm._BatchNorm)]
    norms: dict[int, Any] = {i: layer for i, layer in enumerate(layers)
                             if isinstance(layer, nn.modules.batchnorm._BatchNorm)}
    before = {i: (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
              for i, bn in norms.items()}
    n = x.shape[0]
    sizes = _tensor_split_sizes(n, micro_batches)
    total, start = 0.0, 0
    try:
        for m, size in enumerate(sizes):
            h: Any = x[start:start + size]
            t = y[start:start + size]
            start += size
            for i, (layer, dev) in enumerate(zip(layers, devices)):
                s = reference_seed(seed, step, i, m)
                torch.default_generator.manual_seed(s)
                if dev.type == "cuda":
                    torch.cuda.default_generators[dev.index or 0].manual_seed(s)
                h = layer(_to(h, dev))
            loss = nn.functional.cross_entropy(h, t.to(devices[-1])) * (size / n)
            loss.backward()
            total += float(loss.detach())
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.sub_(lr * p.grad)
        for i, (mean0, var0, count0) in before.items():
            bn = norms[i]
            xs = torch.cat(seen[i])
            dims = [0, *range(2, xs.dim())]
            momentum = bn.momentum if bn.momentum is not None else 1.0 / float(count0 + 1)
            bn.running_mean.copy_((1 - momentum) * mean0 + momentum * xs.mean(dims))
            bn.running_var.copy_((1 - momentum) * var0 + momentum * xs.var(dims, correction=1))
            bn.num_batches_tracked.copy_(count0 + 1)
    return total


# ----------------------------------------------------------------------------- comparing

def tolerances(precision: str, device: torch.device) -> tuple[float, float]:
    """(rtol, atol): fp32 on a CPU as the test suite; looser on a GPU (atomics in some backward
    kernels) and under bf16 autocast (bf16 has 8 bits of mantissa)."""
    if precision == "bf16":
        return 1e-2, 1e-3
    return (1e-4, 1e-5) if device.type == "cuda" else (1e-5, 1e-6)


@contextlib.contextmanager
def precision_context(precision: str, device_types: set[str]) -> Iterator[None]:
    """fp32, or bf16 autocast on every device type the case uses."""
    with contextlib.ExitStack() as stack:
        if precision == "bf16":
            for kind in sorted(device_types):
                stack.enter_context(torch.autocast(device_type=kind, dtype=torch.bfloat16))
        yield


def compare_states(ours: nn.Module, theirs: nn.Module, rtol: float, atol: float) -> dict[str, Any]:
    """Per parameter (gradient and updated value) and per buffer: max abs difference, and which fail."""
    failures: list[str] = []
    worst = 0.0
    mine = dict(ours.named_parameters())
    ref = dict(theirs.named_parameters())
    if mine.keys() != ref.keys():
        return {"ok": False, "failures": [f"parameter names differ: {sorted(mine)} vs {sorted(ref)}"],
                "max_abs_diff": None, "compared": 0}
    pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []
    for name in mine:
        pairs.append((f"{name}.grad", mine[name].grad, ref[name].grad))
        pairs.append((name, mine[name].detach(), ref[name].detach()))
    bufs, ref_bufs = dict(ours.named_buffers()), dict(theirs.named_buffers())
    pairs += [(f"{k} (buffer)", bufs[k], ref_bufs.get(k)) for k in bufs]
    for name, a, b in pairs:
        if a is None or b is None:
            if (a is None) != (b is None):
                failures.append(f"{name}: present in one run only")
            continue
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.shape != b.shape:
            failures.append(f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            continue
        if a.is_floating_point():
            diff = (a.double() - b.double()).abs()
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
            if not torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol):
                failures.append(f"{name}: max |diff| {float(diff.max()):.3g}")
        elif not torch.equal(a, b):
            failures.append(f"{name}: integer values differ")
    return {"ok": not failures, "failures": failures[:8], "max_abs_diff": worst, "compared": len(pairs)}


def _unify_names(layers: Sequence[nn.Module]) -> nn.Sequential:
    return nn.Sequential(*layers)


def run_case(*, label: str, layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor, partitions: int,
             micro_batches: int, checkpoint: str, precision: str, devices: Sequence[torch.device],
             move_after: torch.device | None = None, targets_on_cpu: bool = False,
             seed: int = 0) -> dict[str, Any]:
    """One case: GPipe vs the reference on copies of `layers` (see the module docstring). The inputs
    are given on the CPU (the engine moves them to the first cell); the targets on the last cell's
    device unless `targets_on_cpu`."""
    balance = BALANCES[partitions]
    layer_devices = [d for d, n in zip(devices, balance) for _ in range(n)]
    if move_after is not None:
        layer_devices = [move_after] * len(layers)
    record: dict[str, Any] = {"case": label, "K": partitions, "M": micro_batches, "checkpoint": checkpoint,
                              "precision": precision, "devices": [str(d) for d in devices],
                              "pipe_to": None if move_after is None else str(move_after),
                              "targets_on": "cpu" if targets_on_cpu else str(layer_devices[-1])}
    device_kinds = {d.type for d in layer_devices}
    first = layer_devices[0]
    rtol, atol = tolerances(precision, first if move_after is None else move_after)
    if any(d.type == "cuda" for d in layer_devices):
        rtol, atol = tolerances(precision, torch.device("cuda"))
    record["rtol"], record["atol"] = rtol, atol
    try:
        ref_layers = [copy.deepcopy(layer).to(d) for layer, d in zip(layers, layer_devices)]
        if move_after is None:
            pipe = _deps.GPipe(copy.deepcopy(layers), partitions=partitions, micro_batches=micro_batches,
                               checkpoint=checkpoint, balance=balance, devices=list(devices),
                               loss_fn=nn.CrossEntropyLoss(), seed=seed, precision=precision,
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        else:
            pipe = _deps.GPipe(copy.deepcopy(layers), partitions=partitions, micro_batches=micro_batches,
                               checkpoint=checkpoint, balance=balance, loss_fn=nn.CrossEntropyLoss(),
                               seed=seed, precision=precision,
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
            pipe.to(move_after)
        # The pipe's precision is its own `precision=` (the engine's autocast, which overrides an
        # outer one); the reference runs under the outer autocast.
        with precision_context(precision, device_kinds):
            loss = pipe.train_step(x, y if targets_on_cpu else y.to(layer_devices[-1]))
            ref_loss = reference_step(ref_layers, layer_devices, x, y, micro_batches=micro_batches,
                                      seed=seed)
        states = compare_states(pipe.unpartitioned(), _unify_names(ref_layers), rtol, atol)
        loss_ok = abs(loss - ref_loss) <= atol + rtol * abs(ref_loss)
        record.update(states)
        record.update({"loss": loss, "reference_loss": ref_loss, "ok": states["ok"] and loss_ok})
        if not loss_ok:
            record["failures"] = [f"loss {loss!r} vs reference {ref_loss!r}", *record["failures"]]
    except Exception as e:   # a case that raises is a failed case, reported with its error
        record.update({"ok": False, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc(limit=6)})
    return record


def bf16_available(device: torch.device) -> bool:
    """Whether bf16 autocast can run on the device."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return True


def run_engine_check(settings: Any, device: torch.device) -> dict[str, Any]:
    """Every case of part 1 (see the module docstring); `ok` is True when all cases pass."""
    t0 = time.perf_counter()
    width, n, mbs = settings.engine_width, settings.engine_batch, settings.engine_micro_batches
    g = torch.Generator().manual_seed(settings.seed)
    x = torch.randn(n, width, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    layers = check_model(width, settings.seed)
    precisions = ["fp32"] + (["bf16"] if bf16_available(device) else [])
    cases: list[dict[str, Any]] = []
    skipped: list[str] = []
    if "bf16" not in precisions:
        skipped.append(f"bf16 autocast: not supported by {device}")
    budget = settings.budgets_s.get("engine", float("inf"))

    def over_budget() -> bool:
        return time.perf_counter() - t0 > budget

    for precision in precisions:
        for k in settings.engine_ks:
            for ckpt in CHECKPOINTS:
                if over_budget():
                    skipped.append(f"K={k} {ckpt} {precision}: time budget ({budget:.0f} s) spent")
                    continue
                cases.append(run_case(label=f"K={k} on {device}", layers=layers, x=x, y=y, partitions=k,
                                      micro_batches=mbs, checkpoint=ckpt, precision=precision,
                                      devices=[device] * k, seed=settings.seed))
        mixed = [torch.device("cpu"), device]
        for ckpt in CHECKPOINTS:
            if over_budget():
                skipped.append(f"mixed {ckpt} {precision}: time budget spent")
                continue
            cases.append(run_case(label=f"K=2 on [cpu, {device}]", layers=layers, x=x, y=y, partitions=2,
                                  micro_batches=mbs, checkpoint=ckpt, precision=precision, devices=mixed,
                                  seed=settings.seed))
    cases.append(run_case(label=f"K=2 on [cpu, {device}], targets given on the cpu", layers=layers, x=x, y=y,
                          partitions=2, micro_batches=mbs, checkpoint="except_last", precision="fp32",
                          devices=[torch.device("cpu"), device], targets_on_cpu=True, seed=settings.seed))
    cases.append(run_case(label=f"K=2 built on cpu, then pipe.to({device})", layers=layers, x=x, y=y,
                          partitions=2, micro_batches=mbs, checkpoint="except_last", precision="fp32",
                          devices=[torch.device("cpu")] * 2, move_after=device, seed=settings.seed))
    if device.type != "cuda":
        skipped.append("mixed [cpu, cuda:0] lists and pipe.to('cuda'): no CUDA device; the same cases ran "
                       "with the CPU in the GPU's place")
    return {"ok": all(c["ok"] for c in cases), "cases": cases, "passed": sum(c["ok"] for c in cases),
            "total": len(cases), "skipped": skipped, "seconds": time.perf_counter() - t0,
            "method": "measured", "reference": "plain PyTorch, independent of the engine (module doc)"}


__all__ = ["check_model", "reference_step", "reference_seed", "run_case", "run_engine_check",
           "compare_states", "CHECKPOINTS", "BALANCES"]
