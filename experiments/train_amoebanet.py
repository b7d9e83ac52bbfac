"""AmoebaNet training results: the CPU preset run, K=1 vs K=4 loss curves, and the summary table.

A thin script: the experiment is :mod:`gpipe_repro.repro.train_amoebanet`.
"""
from gpipe_repro.repro.train_amoebanet import main

if __name__ == "__main__":
    main()
