"""Do two throughput tables agree (simulated cells and partitions)?

A thin script: the comparison is :mod:`gpipe_repro.repro.compare_tables`.
"""
from gpipe_repro.repro.compare_tables import main

if __name__ == "__main__":
    main()
