"""`make bench-replicas`: K=1 x R=2 data parallel vs one process, and a K=2 x R=2 Gantt chart.

A thin script: the benchmark is :mod:`gpipe_repro.repro.bench_replicas`.
"""
from gpipe_repro.repro.bench_replicas import main

if __name__ == "__main__":
    main()
