"""Part 2: what the engine costs on the device when there is nothing to pipeline.

For GPT-2 (built from a ``transformers`` config: no download) and a Transformer-L cell (the paper's
layer: d 2048, ff 8192, 32 heads), a plain PyTorch training step (zero_grad, forward, loss, backward,
SGD step) is timed against ``GPipe`` with K=1, M=1 on a copy of the same model, batch and device:
``checkpoint="never"`` (the engine's own overhead; target ratio <= 1.03) and ``checkpoint="always"``
(re-materialization: the paper reports 25-33% extra, its Section 2.3 and time breakdown). The
variants run interleaved, the order rotating every step so that clocks, caches and the allocator
treat them alike; each step ends with a device synchronization; medians after warm-up.

The ratios are measured and reported, never asserted: a timing depends on the machine and on what
else runs on it, so the host load is recorded beside every number.
"""
from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpipe_repro.repro.gpu_check import _deps
from gpipe_repro.repro.gpu_check.settings import sync

TARGET_RATIO = 1.03
PAPER_REMAT_TAX = (0.25, 0.33)


def time_variants(steps: dict[str, Callable[[], Any]], device: torch.device, *, warmup: int,
                  repeats: int) -> dict[str, list[float]]:
    """Seconds of each step function, interleaved and rotated (see the module docstring)."""
    names = list(steps)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(warmup + repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            sync(device)
            t0 = time.perf_counter()
            steps[name]()
            sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def pipe_step(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> Callable[[], float]:
    """One training step of `pipe` on (x, y), as a function of nothing."""
    return lambda: pipe.train_step(x, y)


def overhead_of(name: str, layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor,
                loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device, *, warmup: int,
                repeats: int) -> dict[str, Any]:
    """Plain step vs GPipe K=1 M=1 (never / always) on copies of `layers` (moved to `device`)."""
    load_before = os.getloadavg()
    plain = nn.Sequential(*copy.deepcopy(layers)).to(device)
    opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    x, y = x.to(device), y.to(device)

    def plain_step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(plain(x), y).backward()
        opt.step()

    pipes = {mode: _deps.GPipe([copy.deepcopy(layer).to(device) for layer in layers], partitions=1,
                               micro_batches=1, checkpoint=mode, loss_fn=loss_fn, devices=[device],
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
             for mode in ("never", "always")}
    steps: dict[str, Callable[[], Any]] = {"plain": plain_step}
    for mode, pipe in pipes.items():
        steps[f"gpipe_{mode}"] = pipe_step(pipe, x, y)
    times = time_variants(steps, device, warmup=warmup, repeats=repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    never, always = med["gpipe_never"] / med["plain"], med["gpipe_always"] / med["plain"]
    tax = med["gpipe_always"] / med["gpipe_never"] - 1.0
    return {"model": name, "parameters": sum(p.numel() for layer in layers for p in layer.parameters()),
            "batch": list(x.shape), "median_step_s": {k: _deps.measured(v, unit="s") for k, v in med.items()},
            "ratio_never": _deps.measured(never), "ratio_always": _deps.measured(always),
            "remat_tax": _deps.measured(tax), "within_target": never <= TARGET_RATIO,
            "steps_s": times, "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg())}


def gpt2_case(settings: Any) -> tuple[str, list[nn.Module], torch.Tensor, torch.Tensor]:
    """GPT-2 from a transformers config (GPT-2 small at full size), random token batch."""
    cfg = settings.gpt2
    torch.manual_seed(settings.seed)
    layers = list(_deps.gpt2_layers(_deps.gpt2_config(**cfg)))
    n, t = settings.gpt2_batch
    g = torch.Generator().manual_seed(settings.seed)
    ids = torch.randint(0, cfg["vocab_size"], (n, t), generator=g)
    name = f"GPT-2 ({cfg['n_layer']} layers, d {cfg['n_embd']}) from a transformers config"
    return name, layers, ids, torch.roll(ids, -1, dims=1)


def transformer_cell_case(settings: Any) -> tuple[str, list[nn.Module], torch.Tensor, torch.Tensor]:
    """A Transformer-L cell: L of the paper's layers between an embedding and the softmax head."""
    cfg = dict(settings.cell)
    torch.manual_seed(settings.seed)
    layers = list(_deps.transformer_lm(**cfg))
    n, t = settings.cell_batch
    g = torch.Generator().manual_seed(settings.seed)
    ids = torch.randint(0, cfg["vocab_size"], (n, t), generator=g)
    name = f"Transformer-{cfg['L']} cell (d {cfg['d_model']}, ff {cfg['d_ff']}, {cfg['num_heads']} heads)"
    return name, layers, ids, torch.roll(ids, -1, dims=1)


def run_overhead_check(settings: Any, device: torch.device) -> dict[str, Any]:
    """Both models (see the module docstring); timings measured, ratios reported."""
    t0 = time.perf_counter()
    rows, skipped = [], []
    for make in (gpt2_case, transformer_cell_case):
        if time.perf_counter() - t0 > settings.budgets_s.get("overhead", float("inf")):
            skipped.append(f"{make.__name__}: time budget spent")
            continue
        name, layers, x, y = make(settings)
        try:
            rows.append(overhead_of(name, layers, x, y, _deps.lm_loss, device,
                                    warmup=settings.overhead_warmup, repeats=settings.overhead_steps))
        except torch.cuda.OutOfMemoryError as e:
            skipped.append(f"{name}: out of memory ({e})")
        finally:
            del layers
            _free(device)
    return {"rows": rows, "skipped": skipped, "target_ratio": TARGET_RATIO,
            "paper_remat_tax": list(PAPER_REMAT_TAX), "seconds": time.perf_counter() - t0,
            "method": "measured", "asserted": False}


def _free(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


__all__ = ["run_overhead_check", "overhead_of", "time_variants", "TARGET_RATIO", "PAPER_REMAT_TAX"]
