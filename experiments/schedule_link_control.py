"""Why GPipe can beat 1F1B in the schedule ablation: the same FLOP-model row on the TPU link and on a
free link (simulated; docs/schedules.md).

A thin script: the body is :func:`gpipe_repro.repro.throughput.schedules.link_control`.
"""
from gpipe_repro.repro.throughput.schedules import main

if __name__ == "__main__":
    main()
