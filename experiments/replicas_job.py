"""The K x R job every torchrun process runs (one host or many; see the module's docstring).

A thin script: the job is :mod:`gpipe_repro.repro.replicas_job`.
"""
from gpipe_repro.repro.replicas_job import main

if __name__ == "__main__":
    main()
