"""What one `gpu-check` run does (sizes, repeats, time budgets) and the device it runs on.

Two presets of one :class:`GpuCheckSettings`: :meth:`GpuCheckSettings.full` (the paper's sizes, for
one H100-class GPU, about 10 minutes) and :meth:`GpuCheckSettings.tiny` (toy sizes: the same code
paths in seconds, on a CPU in the test suite). Every part reads its sizes from here and nothing else
differs between the two, so CI exercises every line that a GPU run executes.

Device helpers live here too: :func:`check_device` (a clear error before any work),
:func:`device_info` (name, driver, CUDA/cuDNN versions, memory: recorded in every result) and
:func:`sync` (timings on a GPU must wait for the queued kernels).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

PARTS = ("engine", "overhead", "memory", "costs")


@dataclass(frozen=True, kw_only=True)
class GpuCheckSettings:
    """Everything that decides a gpu-check run (recorded in its JSON)."""

    device: str = "cuda:0"
    tiny: bool = False
    parts: tuple[str, ...] = PARTS
    seed: int = 0
    # (1) engine equality
    engine_ks: tuple[int, ...] = (1, 2, 3, 4)
    engine_micro_batches: int = 4
    engine_batch: int = 10                 # 10 into 4 micro-batches: sizes 3, 3, 2, 2 (uneven on purpose)
    engine_width: int = 16
    # (2) overhead: GPT-2 (transformers config) and a Transformer-L cell
    gpt2: dict[str, int] = field(default_factory=lambda: {"n_layer": 12, "n_embd": 768, "n_head": 12,
                                                          "vocab_size": 50257, "n_positions": 1024})
    gpt2_batch: tuple[int, int] = (8, 1024)              # sequences x tokens
    cell: dict[str, int] = field(default_factory=lambda: {"L": 6, "d_model": 2048, "d_ff": 8192,
                                                          "num_heads": 32, "vocab_size": 32000})
    cell_batch: tuple[int, int] = (2, 1024)
    overhead_warmup: int = 3
    overhead_steps: int = 15
    # (3) memory: Table 1 rows run one cell alone; the Naive-1 / Pipeline-1 depth bisection
    memory_rows: tuple[tuple[str, str, dict[str, int], int, int, str], ...] = (
        # (label, family, options, K, M, checkpoint): Table 1's configurations
        ("Transformer Naive-1", "transformer-lm", {"L": 3}, 1, 1, "never"),
        ("Transformer Pipeline-1", "transformer-lm", {"L": 13}, 1, 8, "except_last"),
        ("Transformer Pipeline-8", "transformer-lm", {"L": 103}, 8, 8, "except_last"),
        ("AmoebaNet-D Naive-1", "amoebanet-d", {"L": 18, "F": 208}, 1, 1, "never"),
        ("AmoebaNet-D Pipeline-8", "amoebanet-d", {"L": 72, "F": 512}, 8, 8, "except_last"),
    )
    memory_batch: dict[str, int] = field(default_factory=dict)   # family -> batch (default: paper's)
    memory_extra: dict[str, dict[str, int]] = field(default_factory=dict)  # family -> options
    memory_target: float = 0.05
    depth_dims: dict[str, int] = field(default_factory=lambda: {"d_model": 2048, "d_ff": 8192,
                                                                "heads": 32, "vocab": 32000})
    depth_batch: tuple[int, int] = (32, 1024)
    depth_micro_batches: int = 8
    depth_budget_bytes: int | None = None   # None on CUDA: the device's free memory; CPU: required
    depth_max_layers: int = 512
    # (4) costs on the device -> Tables 2 and 3
    costs_table2: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        "amoebanet": {"family": "amoebanet-d", "kind": "image", "shape": (3, 224, 224), "classes": 1000,
                      "options": {"L": 18, "F": 256, "num_classes": 1000, "image_size": 224,
                                  "aux_head": False},
                      "name": "AmoebaNet-D (18, 256), 224x224", "microbatch": 8},
        "transformer": {"family": "transformer-lm", "kind": "tokens", "shape": (1024,), "classes": 32000,
                        "options": {"L": 48}, "name": "Transformer-48 (d 2048, ff 8192, seq 1024)",
                        "microbatch": 1}})
    costs_table3: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        "amoebanet": {"family": "amoebanet-d", "kind": "image", "shape": (3, 224, 224), "classes": 1000,
                      "options": {"L": 18, "F": 128, "num_classes": 1000, "image_size": 224,
                                  "aux_head": False},
                      "name": "AmoebaNet-D (18, 128), 224x224", "microbatch": 8},
        "transformer": {"family": "transformer-lm", "kind": "tokens", "shape": (1024,), "classes": 32000,
                        "options": {"L": 24}, "name": "Transformer-24 (d 2048, ff 8192, seq 1024)",
                        "microbatch": 1}})
    costs_ks: tuple[int, ...] = (2, 4, 8)
    costs_ms: tuple[int, ...] = (1, 4, 32)
    costs_repeats: int = 10
    # Seconds each part may take before it stops and reports what it has (the whole run: < 10 min).
    budgets_s: dict[str, float] = field(default_factory=lambda: {"engine": 60, "overhead": 90,
                                                                 "memory": 240, "costs": 150})

    @classmethod
    def full(cls, device: str = "cuda:0", **overrides: Any) -> GpuCheckSettings:
        """The paper's sizes (for one H100-class GPU)."""
        return cls(device=device, tiny=False, **overrides)

    @classmethod
    def tiny_preset(cls, device: str = "cpu", **overrides: Any) -> GpuCheckSettings:
        """Toy sizes: every code path of :meth:`full` in seconds, on a CPU."""
        tiny_lm = {"d_model": 32, "d_ff": 64, "num_heads": 2, "vocab_size": 64}
        tiny_costs: dict[str, dict[str, Any]] = {
            "amoebanet": {"family": "amoebanet-d", "kind": "image", "shape": (3, 32, 32), "classes": 10,
                          "options": {"L": 3, "F": 8, "num_classes": 10, "image_size": 32, "aux_head": False},
                          "name": "AmoebaNet-D (3, 8), 32x32 (tiny)", "microbatch": 2},
            "transformer": {"family": "transformer-lm", "kind": "tokens", "shape": (16,), "classes": 64,
                            "options": {"L": 8, **tiny_lm}, "name": "Transformer-8 (d 32, tiny)",
                            "microbatch": 1}}
        base = cls(
            device=device, tiny=True,
            engine_ks=(1, 2, 4), engine_width=8,
            gpt2={"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32},
            gpt2_batch=(2, 16), cell={"L": 2, **tiny_lm}, cell_batch=(2, 16),
            overhead_warmup=1, overhead_steps=3,
            memory_rows=(
                ("Transformer Naive-1", "transformer-lm", {"L": 2}, 1, 1, "never"),
                ("Transformer Pipeline-4", "transformer-lm", {"L": 6}, 4, 4, "except_last"),
                ("AmoebaNet-D Pipeline-2", "amoebanet-d", {"L": 3, "F": 4}, 2, 2, "except_last"),
            ),
            memory_batch={"transformer-lm": 8, "amoebanet-d": 4},
            memory_extra={"transformer-lm": {**tiny_lm, "seq_len": 16},
                          "amoebanet-d": {"image_size": 16, "num_classes": 10}},
            depth_dims={"d_model": 32, "d_ff": 64, "heads": 2, "vocab": 64},
            depth_batch=(8, 16), depth_micro_batches=4, depth_budget_bytes=2 << 20, depth_max_layers=64,
            costs_table2=tiny_costs, costs_table3=tiny_costs,   # one set of models, timed once
            costs_ks=(2, 4), costs_ms=(1, 4), costs_repeats=1,   # one timed repeat: the code path
            # no time budgets: the toy run must take every code path however loaded the host is
            # (a budget spent on a busy CI host skipped the transformer tables once)
            budgets_s={})
        return replace(base, **overrides)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- the device

def check_device(device: str) -> torch.device:
    """The device as a torch.device, or a ValueError saying what to change (before any work)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--device {device!r} is not a device torch knows ({e}); use cuda:0 or cpu") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"--device {device!r}: gpu-check runs on cuda:N or cpu, not {dev.type}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch {torch.__version__} sees no CUDA GPU here "
                         f"(torch.version.cuda={torch.version.cuda}); install a CUDA build of torch on a "
                         "GPU host, or run the CPU smoke test: --device cpu --tiny")
    index = dev.index if dev.index is not None else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible "
                         f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timings and memory peaks on a GPU need it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi, or None where there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def device_info(device: torch.device) -> dict[str, Any]:
    """What the results must record about the device: name, driver, CUDA/cuDNN, memory, math modes."""
    from gpipe_repro.report.provenance import cpu_model
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__,
                            "load_average": list(os.getloadavg())}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({"name": props.name, "driver": driver_version(), "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version(), "total_memory_bytes": props.total_memory,
                     "capability": f"{props.major}.{props.minor}",
                     "multiprocessors": props.multi_processor_count,
                     "bf16": bool(torch.cuda.is_bf16_supported()),
                     "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
                     "cudnn_tf32": torch.backends.cudnn.allow_tf32})
    else:
        info.update({"name": cpu_model(), "driver": None, "cuda": None, "bf16": True,
                     "threads": torch.get_num_threads()})
    return info


def device_slug(info: dict[str, Any]) -> str:
    """A directory name for the device: "nvidia-h100-80gb-hbm3", "cpu-intel-xeon-...". """
    name = str(info.get("name") or info["device"])
    prefix = "" if str(info["device"]).startswith("cuda") else "cpu-"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return (prefix + slug)[:80] or "device"


__all__ = ["GpuCheckSettings", "PARTS", "check_device", "sync", "device_info", "device_slug",
           "driver_version"]
