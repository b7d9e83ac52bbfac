"""`make bench-schedules`: every schedule of ours vs every torch.distributed.pipelining schedule.

A thin script: the experiment is :mod:`gpipe_repro.repro.bench_schedules`.
"""
from gpipe_repro.repro.bench_schedules import main

if __name__ == "__main__":
    main()
