"""Suite-wide settings: one torch thread.

The suite runs on 2 cores, often beside other work; tiny-op models run many times slower with two
threads fighting over them. Tests that measure parallel speed spawn their own processes and pin
their own thread counts.
"""
import torch

torch.set_num_threads(1)
