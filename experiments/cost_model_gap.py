"""Where the simulator's step time departs from a real run's, per stage and action kind.

A thin script: the diagnostic is :mod:`gpipe_repro.repro.cost_model_gap`.
"""
from gpipe_repro.repro.cost_model_gap import main

if __name__ == "__main__":
    main()
