"""`make bench-latency`: how long `gpipe-repro fit` (80B Transformer) and an offline W&B run take.

A thin script: the benchmark is :mod:`gpipe_repro.repro.bench_latency`.
"""
from gpipe_repro.repro.bench_latency import main

if __name__ == "__main__":
    main()
