"""`make baseline`: the committed speedup baseline that CI holds the pipeline to.

A thin script: the experiment is :mod:`gpipe_repro.repro.speedup_baseline`.
"""
from gpipe_repro.repro.speedup_baseline import main

if __name__ == "__main__":
    main()
