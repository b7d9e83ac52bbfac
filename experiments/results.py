"""`make results`: every table and validation page of record, regenerated from a clean commit.

A thin script: the driver is :mod:`gpipe_repro.repro.results` (``--dry-run`` prints the plan).
"""
from gpipe_repro.repro.results import main

if __name__ == "__main__":
    main()
