"""`make memory-table`: the GPipe paper's Table 1 (maximum model size), reproduced by the planner.

A thin script: the experiment is :mod:`gpipe_repro.repro.memory_table`. This entry point is the make
target's: it replaces its own previous table (the results of record) without --overwrite.
"""
from gpipe_repro.repro.memory_table import main

if __name__ == "__main__":
    main(record=True)
