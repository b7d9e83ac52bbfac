"""`make validate-sim`: the pipeline simulator against real stage processes.

A thin script: the experiment is :mod:`gpipe_repro.repro.validate_simulator`. This entry point is the
make target's: it replaces its own previous validation (the results of record) without --overwrite.
"""
from gpipe_repro.repro.validate_simulator import main

if __name__ == "__main__":
    main(record=True)
