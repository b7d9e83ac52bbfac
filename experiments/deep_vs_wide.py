"""Deep vs wide multilingual Transformers (the paper's section 5), at CPU scale.

A thin script: the experiment is :mod:`gpipe_repro.repro.deep_vs_wide`.
"""
from gpipe_repro.repro.deep_vs_wide import main

if __name__ == "__main__":
    main()
