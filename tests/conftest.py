"""Suite-wide settings: one torch thread.

The suite runs on 2 cores, often beside other work; tiny-op models run many times slower with two
threads fighting over them. Tests that measure parallel speed spawn their own processes and pin
their own thread counts.

Distributed jobs run over gloo on the CPU, whatever GPUs the host has: the suite checks the engine's
semantics against CPU references (a one-GPU host would otherwise fall back with a warning, and a
multi-GPU one would run NCCL with TF32 convolutions). `make gpu-check` is where GPUs are tested.
"""
import os

import torch

os.environ.setdefault("GPIPE_REPRO_BACKEND", "gloo")

torch.set_num_threads(1)
