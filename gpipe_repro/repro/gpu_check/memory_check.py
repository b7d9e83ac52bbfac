"""Part 3: the memory planner against the device, at the paper's sizes.

**One cell alone.** For each Table 1 configuration (model, K, M, re-materialization) the planner
plans the whole pipeline on the meta device; the cell with the largest peak is then built for real
on the device and runs its stage of the schedule alone, through the engine's own
:class:`~gpipe_repro.engine.stage.StageExecutor`: its neighbours are replaced by a transport that
hands it tensors of the right shapes (the previous cell's output for each micro-batch; gradients
shaped like its own output) and drops what it sends. The step is a steady-state one (optimizer state
primed, RMSProp updating the cell in one multi-tensor pass, the planner's convention); the mini-batch
lives on the first device and the targets on the last, as the planner assumes. The device's peak
(``torch.cuda.max_memory_allocated`` over the step, minus what was allocated before the cell was
built) is compared with the planner's prediction for that cell; the target is within 5%.

**How deep fits.** The deepest Transformer-L (the paper's layer, its batch of 32 x 1024 tokens) that
trains on this device as Naive-1 (K=1, M=1, no re-materialization) and as Pipeline-1 (K=1, M=8,
re-materialization), found by running real steps, beside the planner's answer for the same memory
(the device's free memory when the search starts). The search starts at the planner's answer and
brackets outward, so a right planner costs two steps per row.

On a CPU (``--device cpu --tiny``) there is no allocator peak to read: the project's
:class:`~gpipe_repro.memory.tracker.MemoryTracker` measures the live tensor storage instead, and the
depth search uses a fixed byte budget (``depth_budget_bytes``) in place of the device's memory. The
code that runs is otherwise the same.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.agreement import Contribution
from gpipe_repro.repro.gpu_check import _deps
from gpipe_repro.repro.gpu_check.settings import sync


def free(device: torch.device) -> None:
    """Return everything freed to the device (between measurements). On a CPU nothing to do: the
    tracker counts only storages made or registered while it runs (and a full collection of this
    process's heap costs half a second)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _state_tensors(modules: list[nn.Module], optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    out = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    if optimizer is not None:
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def measure_peak(device: torch.device, state: list[torch.Tensor], data: list[torch.Tensor],
                 step: Callable[[], None], base: int = 0) -> tuple[int, bool]:
    """(peak bytes, out of memory) of `step` on `device`, counting `state` and `data` already there.

    CUDA: the allocator's peak over the step minus `base` (bytes allocated before the model was
    built). CPU: the live storage bytes the memory tracker sees, with `state` and `data` counted."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            step()
            sync(device)
        except torch.cuda.OutOfMemoryError:
            return torch.cuda.max_memory_allocated(device) - base, True
        return torch.cuda.max_memory_allocated(device) - base, False
    with _deps.MemoryTracker() as tracker:
        tracker.register(state, "cpu", "state")
        tracker.register(data, "cpu", "data")
        step()
    return tracker.devices["cpu"].peak, False


# ----------------------------------------------------------------------------- one cell alone

class NeighbourTransport:
    """Stands in for the cells around the measured one: receives are fresh tensors shaped like what
    the neighbour would send (the previous cell's output, the gradient of this cell's output); sends
    are dropped, as a real send frees the sender's copy once it has left."""

    def __init__(self, inputs: dict[int, Any], outputs: dict[int, Any], device: torch.device) -> None:
        self.inputs, self.outputs, self.device = inputs, outputs, device

    def send_activation(self, stage: int, microbatch: int, value: Any) -> None:
        del value

    def recv_activation(self, stage: int, microbatch: int) -> Any:
        value = _deps.materialize_value(self.inputs[microbatch], self.device, seed=microbatch)
        return _deps.boundary.map_tensors(value, lambda t: t.requires_grad_(_deps.boundary.carries_grad(t)))

    def send_gradient(self, stage: int, microbatch: int, grads: list[torch.Tensor | None]) -> None:
        del grads

    def recv_gradient(self, stage: int, microbatch: int) -> list[torch.Tensor | None]:
        outs = [t for t in _deps.boundary.tensors(self.outputs[microbatch]) if _deps.boundary.carries_grad(t)]
        return [_deps.materialize_value(t, self.device, seed=microbatch) for t in outs]

    def agree(self, stage: int, contribution: Callable[[], Contribution]) -> Contribution:
        """The schedule's AGREE: the measured cell alone stands for every stage."""
        return contribution()


def _meta_boundaries(layers: list[nn.Module], sample: Any, sizes: list[int], first: int,
                     count: int) -> tuple[dict[int, Any], dict[int, Any]]:
    """For each micro-batch: the (meta) value entering layer `first` and leaving layer first+count-1."""
    ins, outs = {}, {}
    by_size: dict[int, tuple[Any, Any]] = {}
    with torch.no_grad():
        for m, size in enumerate(sizes):
            if size not in by_size:
                x = _deps.boundary.map_tensors(sample, lambda t, n=size: torch.empty(
                    (n, *t.shape[1:]), dtype=t.dtype, device="meta"))
                entering = x
                for i, layer in enumerate(layers[:first + count]):
                    if i == first:
                        entering = x
                    x = layer(x)
                by_size[size] = (entering, x)
            ins[m], outs[m] = by_size[size]
    return ins, outs


def lone_cell(row: tuple[str, str, dict[str, int], int, int, str], settings: Any,
              device: torch.device) -> dict[str, Any]:
    """Plan one Table 1 configuration, run its largest cell alone, compare (see the module doc)."""
    label, family, options, k, m, ckpt = row
    batch = settings.memory_batch.get(family)
    work = _deps.memory_workload(family, batch, **{**options, **settings.memory_extra.get(family, {})})
    layers, meta_sample, meta_target, loss_fn = work.planner_inputs()
    planner = _deps.MemoryPlanner(layers, meta_sample, meta_target, loss_fn,
                                  optimizer=_deps.rmsprop_foreach, attention="fused", optimizer_foreach=True)
    plan = planner.plan(k, m, ckpt)
    s = plan.bottleneck_stage
    first, count = sum(plan.balance[:s]), plan.balance[s]
    last = s == k - 1
    sizes = plan.microbatch_sizes
    ins, outs = _meta_boundaries(layers, meta_sample, sizes, first, count)
    record: dict[str, Any] = {"row": label, "model": work.describe(), "K": k, "M": m, "checkpoint": ckpt,
                              "balance": plan.balance, "stage": s, "layers": [first, first + count],
                              "planned_parts_bytes": dict(plan.stages[s].parts),
                              "planned_peak_at": plan.stages[s].peak_at}
    free(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    cell = nn.Sequential(*[_deps.DeferredBatchNorm.convert(_deps.materialize(layer, device))
                           for layer in layers[first:first + count]]).train()
    opt = _deps.rmsprop_foreach(list(cell.parameters())) if any(True for _ in cell.parameters()) else None
    _deps.prime_optimizer(opt)
    data: list[torch.Tensor] = []
    microbatches = targets = weights = None
    if s == 0:
        sample = _deps.materialize_value(meta_sample, device)
        microbatches = [sample[a:a + n] for a, n in zip(_offsets(sizes), sizes)]
        data.append(sample)
    if last:
        target = _deps.materialize_value(meta_target, device)
        targets = [target[a:a + n] for a, n in zip(_offsets(sizes), sizes)]
        weights = [n / sum(sizes) for n in sizes]
        data.append(target)
    transport = NeighbourTransport(ins, outs, device)
    executor = _deps.StageExecutor(cell, s, k, first, device, transport, loss_fn if last else None,
                                   opt, settings.seed)
    schedule = _deps.make_schedule("gpipe", k, m, ckpt)

    def step() -> None:
        executor.begin_step(1, schedule, microbatches, targets, weights)
        for action in schedule.stages[s]:
            executor.execute(action)
        executor.end_step()

    peak, oom = measure_peak(device, _state_tensors([cell], opt), data, step, base)
    planned = plan.stages[s].peak
    error = (planned - peak) / peak if peak and not oom else None
    record.update({"measured_peak_bytes": _deps.measured(peak, unit="B"),
                   "planned_peak_bytes": _deps.simulated(planned, unit="B"), "out_of_memory": oom,
                   "rel_error": error,
                   "within_target": error is not None and abs(error) <= settings.memory_target,
                   "meter": "torch.cuda.max_memory_allocated" if device.type == "cuda" else
                   "MemoryTracker (live tensor storage; CPU)"})
    return record


def _offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


# ----------------------------------------------------------------------------- how deep fits

def depth_rows(settings: Any) -> list[tuple[str, int, str]]:
    """(name, M, checkpoint) of the two rows searched: Naive-1 and Pipeline-1."""
    return [("Naive-1", 1, "never"), ("Pipeline-1", settings.depth_micro_batches, "except_last")]


def planned_depth(settings: Any, micro_batches: int, checkpoint: str, budget: int,
                  cache: Any) -> tuple[int | None, dict[int, int]]:
    """The planner's deepest Transformer-L within `budget` bytes (its planned peaks by L)."""
    dims = settings.depth_dims
    n, t = settings.depth_batch
    x = torch.empty((n, t), dtype=torch.long, device="meta")
    peaks: dict[int, int] = {}

    def fits(L: int) -> bool:
        planner = _deps.MemoryPlanner(_deps.transformer_runs(L, **dims), x, x, _deps.lm_loss,
                                      _deps.rmsprop_foreach, "fused", True, cache)
        peaks[L] = planner.plan(1, micro_batches, checkpoint).max_peak
        return peaks[L] <= budget

    return _deps.largest(0, settings.depth_max_layers, fits), peaks


def real_step_peak(settings: Any, device: torch.device, L: int, micro_batches: int,
                   checkpoint: str) -> tuple[int, bool]:
    """(peak bytes, out of memory) of one real steady-state step of Transformer-L on `device`."""
    dims = settings.depth_dims
    n, t = settings.depth_batch
    free(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        torch.manual_seed(settings.seed)
        with torch.device(device):
            layers = list(_deps.transformer_lm(L, d_model=dims["d_model"], d_ff=dims["d_ff"],
                                               num_heads=dims["heads"], vocab_size=dims["vocab"]))
        pipe = _deps.GPipe(layers, partitions=1, micro_batches=micro_batches, checkpoint=checkpoint,
                           loss_fn=_deps.lm_loss, loss_reduction="mean",   # no first-step check
                           optimizer=_deps.rmsprop_foreach, devices=[device])
        opt = pipe.optimizers[0]
        _deps.prime_optimizer(opt)
        x = torch.randint(0, dims["vocab"], (n, t), device=device)
        def step() -> None:
            pipe.train_step(x, x)

        return measure_peak(device, _state_tensors(list(pipe.cells), opt), [x], step, base)
    except torch.cuda.OutOfMemoryError:
        return -1, True


def bracket_search(guess: int, lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The largest x in [lo, hi] with fits(x) (monotone), starting at `guess`: step outward by
    doubling until the answer is bracketed, then bisect. Two probes when the guess is right."""
    known: dict[int, bool] = {}

    def probe(x: int) -> bool:
        if x not in known:
            known[x] = fits(x)
        return known[x]

    g = min(hi, max(lo, guess))
    step = 1
    if probe(g):
        good = g
        while True:
            nxt = min(hi, good + step)
            if nxt == good:
                return good
            if not probe(nxt):
                bad = nxt
                break
            good, step = nxt, step * 2
    else:
        bad = g
        while True:
            if bad == lo:
                return None
            nxt = max(lo, bad - step)
            if probe(nxt):
                good = nxt
                break
            bad, step = nxt, step * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    return good


def depth_search(settings: Any, device: torch.device, deadline: float) -> dict[str, Any]:
    """Naive-1 and Pipeline-1: the deepest Transformer-L by real steps, beside the planner's."""
    free(device)
    if device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(device)[0]) + torch.cuda.memory_allocated(device)
        source = "the device's free memory when the search started (torch.cuda.mem_get_info)"
    else:
        if settings.depth_budget_bytes is None:
            raise ValueError("on a CPU the depth search needs depth_budget_bytes (there is no device memory)")
        budget = int(settings.depth_budget_bytes)
        source = "a fixed budget (CPU smoke test: depth_budget_bytes)"
    cache = _deps.ProfileCache()
    rows = []
    for name, m, ckpt in depth_rows(settings):
        plan_L, plan_peaks = planned_depth(settings, m, ckpt, budget, cache)
        probes: list[dict[str, Any]] = []

        def fits(L: int, m: int = m, ckpt: str = ckpt, probes: list[dict[str, Any]] = probes,
                 plan_peaks: dict[int, int] = plan_peaks) -> bool:
            if time.perf_counter() > deadline:
                raise TimeoutError
            peak, oom = real_step_peak(settings, device, L, m, ckpt)
            ok = not oom and peak <= budget
            probes.append({"L": L, "fits": ok, "out_of_memory": oom, "peak_bytes": None if oom else peak,
                           "planned_peak_bytes": plan_peaks.get(L)})
            return ok

        try:
            real_L = bracket_search(plan_L or 0, 0, settings.depth_max_layers, fits)
            stopped = None
        except TimeoutError:
            real_L, stopped = None, "time budget spent before the search ended"
        rows.append({"row": name, "M": m, "checkpoint": ckpt,
                     "measured_L": _deps.measured(real_L), "planned_L": _deps.simulated(plan_L),
                     "probes": probes, "stopped": stopped})
    dims = settings.depth_dims
    return {"budget_bytes": budget, "budget_source": source, "rows": rows,
            "model": f"Transformer-L (d {dims['d_model']}, ff {dims['d_ff']}, {dims['heads']} heads, "
                     f"vocab {dims['vocab']}), batch {settings.depth_batch[0]} x {settings.depth_batch[1]}"}


def run_memory_check(settings: Any, device: torch.device) -> dict[str, Any]:
    """Both halves of part 3 (see the module docstring)."""
    t0 = time.perf_counter()
    deadline = t0 + settings.budgets_s.get("memory", float("inf"))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    # Memory does not depend on the matmul precision mode; TF32 makes the deep probes several times faster.
    torch.backends.cuda.matmul.allow_tf32 = True
    cells, skipped = [], []
    try:
        for row in settings.memory_rows:
            if time.perf_counter() > deadline:
                skipped.append(f"{row[0]}: time budget spent")
                continue
            try:
                cells.append(lone_cell(row, settings, device))
            except torch.cuda.OutOfMemoryError as e:
                skipped.append(f"{row[0]}: out of memory building the cell ({str(e)[:120]})")
                free(device)
        depth = depth_search(settings, device, deadline)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    errors = [abs(c["rel_error"]) for c in cells if c["rel_error"] is not None]
    return {"cells": cells, "depth": depth, "skipped": skipped, "target": settings.memory_target,
            "worst_rel_error": max(errors) if errors else None,
            "within_target": bool(errors) and all(c["within_target"] for c in cells),
            "methods": {"cells.measured_peak_bytes": "measured", "cells.planned_peak_bytes": "simulated",
                        "depth.rows.probes.peak_bytes": "measured",
                        "depth.rows.probes.planned_peak_bytes": "simulated",
                        "depth.rows.measured_L": "measured", "depth.rows.planned_L": "simulated"},
            "seconds": time.perf_counter() - t0}


__all__ = ["run_memory_check", "lone_cell", "depth_search", "bracket_search", "measure_peak",
           "NeighbourTransport", "planned_depth", "real_step_peak"]
