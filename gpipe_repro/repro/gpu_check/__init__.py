"""`make gpu-check` / `gpipe-repro gpu-check --device cuda:0`: the engine, the memory planner and the
cost model validated on one GPU, at the paper's sizes, in under 10 minutes.

Four parts, each its own module, each run at the paper's sizes on a GPU and at toy sizes with
``--tiny`` (the test suite runs ``--device cpu --tiny``, so every line is exercised on every commit):

1. :mod:`.engine_check`: GPipe equals an independent plain-PyTorch reference, per parameter;
2. :mod:`.overhead`: GPipe K=1 M=1 against a plain step (GPT-2, a Transformer-L cell), and the
   re-materialization tax;
3. :mod:`.memory_check`: one cell of a Table 1 pipeline alone on the device against the planner, and
   the deepest Transformer-L that really fits (Naive-1, Pipeline-1) beside the planner's answer;
4. :mod:`.costs`: per-layer costs calibrated on the device, Tables 2 and 3 simulated from them.

:func:`run_gpu_check` returns one JSON-ready payload; :mod:`.report` writes it (results/gpu/<device>/)
and prints the summary. Settings: :class:`GpuCheckSettings` (``full()`` / ``tiny_preset()``).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpipe_repro.repro.gpu_check.report import OutputRefused, check_out_dir, summary, write_report
from gpipe_repro.repro.gpu_check.settings import (
    PARTS,
    GpuCheckSettings,
    check_device,
    device_info,
    device_slug,
)


def default_out_dir(device: str, root: str | Path | None = None) -> Path:
    """results/gpu/<device name>/ for `device` (e.g. results/gpu/nvidia-h100-80gb-hbm3/); results/ is
    `root`, else $GPIPE_REPRO_RESULTS, else ./results."""
    from gpipe_repro.report.records import results_root
    base = Path(root) if root is not None else results_root()
    return base / "gpu" / device_slug(device_info(check_device(device)))


def run_gpu_check(settings: GpuCheckSettings, *,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the parts `settings` names on its device; return the payload (see the package docstring)."""
    import torch

    from gpipe_repro.repro.gpu_check.costs import run_costs_check
    from gpipe_repro.repro.gpu_check.engine_check import run_engine_check
    from gpipe_repro.repro.gpu_check.memory_check import run_memory_check
    from gpipe_repro.repro.gpu_check.overhead import run_overhead_check

    unknown = sorted(set(settings.parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    device = check_device(settings.device)
    say = progress or (lambda msg: None)
    runners = {"engine": run_engine_check, "overhead": run_overhead_check, "memory": run_memory_check,
               "costs": run_costs_check}
    t0 = time.perf_counter()
    payload: dict[str, Any] = {"experiment": "gpu-check", "settings": settings.to_json(),
                               "device": device_info(device), "parts": {}}
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)      # the toy models are far too small to share between threads
    try:
        for name in PARTS:
            if name not in settings.parts:
                continue
            say(f"part {PARTS.index(name) + 1}/4: {name}")
            payload["parts"][name] = runners[name](settings, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(threads)
    payload["seconds"] = time.perf_counter() - t0
    payload["device"]["load_average_end"] = list(os.getloadavg())
    return payload


__all__ = ["GpuCheckSettings", "PARTS", "run_gpu_check", "write_report", "summary", "check_out_dir",
           "default_out_dir", "OutputRefused"]
