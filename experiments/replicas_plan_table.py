"""`make replicas-plan-table`: K x R x M for Transformer-L and AmoebaNet-D on 8 to 2048 devices.

A thin script: the experiment is :mod:`gpipe_repro.repro.replicas_plan_table`.
"""
from gpipe_repro.repro.replicas_plan_table import main

if __name__ == "__main__":
    main()
