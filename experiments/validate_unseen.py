"""`make validate-unseen`: the simulator on models it was never tuned on (K=2, real stage processes).

A thin script: the experiment is :mod:`gpipe_repro.repro.validate_unseen`.
"""
from gpipe_repro.repro.validate_unseen import main

if __name__ == "__main__":
    main()
