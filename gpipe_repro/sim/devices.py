"""Models of devices that turn FLOPs into seconds (deterministic costs, no hardware needed)."""
from __future__ import annotations

from dataclasses import dataclass


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


