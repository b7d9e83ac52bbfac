"""`make throughput-table`: the GPipe paper's Tables 2 and 3 (normalized throughput over K x M).

A thin script: the experiment is :mod:`gpipe_repro.repro.throughput_table`. This entry point is the
make target's: it replaces its own previous table (the results of record) without --overwrite.
"""
from gpipe_repro.repro.throughput_table import main

if __name__ == "__main__":
    main(record=True)
