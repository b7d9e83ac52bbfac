"""`make check-regression-detector`: the CI speedup regression against a healthy tree and four breakages.

A thin script: the experiment is :mod:`gpipe_repro.repro.regression_detector`.
"""
from gpipe_repro.repro.regression_detector import main

if __name__ == "__main__":
    main()
