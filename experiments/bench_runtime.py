"""`make bench-runtime`: the distributed runtime's speedup, against the ideal and against

A thin script: the experiment is :mod:`gpipe_repro.repro.bench_runtime`.
"""
from gpipe_repro.repro.bench_runtime import main

if __name__ == "__main__":
    main()
