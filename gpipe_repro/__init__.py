"""gpipe-repro: GPipe pipeline-parallel training for PyTorch.

The engine in one line: ``GPipe(layers, partitions=K, micro_batches=M).train_step(x, y)``.
It needs torch and numpy only (``pip install gpipe-repro``); the command line and the paper's
experiments are extras. See docs/design.md for the map of modules.
"""
from gpipe_repro.engine.batchnorm import DeferredBatchNorm
from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.engine.partition import partition
from gpipe_repro.engine.recompute import is_recomputing
from gpipe_repro.engine.schedule import Action, ActionKind, Schedule, gpipe_schedule, one_f_one_b_schedule

__all__ = ["GPipe", "DeferredBatchNorm", "is_recomputing", "partition", "Action", "ActionKind",
           "Schedule", "gpipe_schedule", "one_f_one_b_schedule"]
