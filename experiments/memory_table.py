"""`make memory-table`: the GPipe paper's Table 1 (maximum model size), reproduced by the planner.

A thin script: the experiment is :mod:`gpipe_repro.repro.memory_table`.
"""
from gpipe_repro.repro.memory_table import main

if __name__ == "__main__":
    main()
