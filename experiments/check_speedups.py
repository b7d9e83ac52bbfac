"""`make check-speedups`: the measured K=2 speedup against the committed baseline (a benchmark).

A thin script: the benchmark is :mod:`gpipe_repro.repro.check_speedups`.
"""
from gpipe_repro.repro.check_speedups import main

if __name__ == "__main__":
    main()
