"""Ours against torch.distributed.pipelining, best schedule against best, on the uniform MLP and three
heterogeneous models; writes results/schedules/versus_torch.{json,md} (from a clean tree only).

A thin script: the experiment is :mod:`gpipe_repro.repro.versus_torch`.
"""
from gpipe_repro.repro.versus_torch import main

if __name__ == "__main__":
    main(record=True)
