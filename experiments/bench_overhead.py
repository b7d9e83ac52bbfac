"""`make bench-overhead`: what the engine costs when there is nothing to pipeline.

A thin script: the experiment is :mod:`gpipe_repro.repro.bench_overhead`.
"""
from gpipe_repro.repro.bench_overhead import main

if __name__ == "__main__":
    main()
