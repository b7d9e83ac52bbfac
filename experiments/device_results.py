"""`make device-results`: a lent GPU host's results in at most 8 minutes (``--tiny``: toy sizes on a CPU).

A thin script: the driver is :mod:`gpipe_repro.repro.device_results` (``--dry-run`` prints the plan).
"""
from gpipe_repro.repro.device_results import main

if __name__ == "__main__":
    main()
