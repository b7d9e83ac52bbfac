"""Probe: per-micro-batch cost of the headline model on a GPU, engine against plain PyTorch.

A thin script: the probe is :mod:`gpipe_repro.repro.probe_gpu_microbatches`.
"""
from gpipe_repro.repro.probe_gpu_microbatches import main

if __name__ == "__main__":
    main()
