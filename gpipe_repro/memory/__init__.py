"""Per-device memory of a GPipe training step, without the devices.

- :mod:`~gpipe_repro.memory.tracker`: live bytes per device from storage lifetimes (real or fake).
- :mod:`~gpipe_repro.memory.trace`: the engine's own ``train_step`` measured per stage (the reference).
- :mod:`~gpipe_repro.memory.profile`: one layer's memory in each pass, measured once on fake tensors.
- :mod:`~gpipe_repro.memory.compose`: a stage's actions from the schedule replayed over the profiles.
- :mod:`~gpipe_repro.memory.planner`: :class:`MemoryPlanner`, a peak and its parts per device.
- :mod:`~gpipe_repro.memory.search`, :mod:`~gpipe_repro.repro.memory_table.table1`: the paper's Table 1.
- :mod:`~gpipe_repro.memory.advice`, :mod:`~gpipe_repro.memory.autoplan`: ``gpipe-repro fit``/``plan``.
"""
from gpipe_repro.memory.planner import GiB, MemoryPlan, MemoryPlanner
from gpipe_repro.memory.tracker import MemoryTracker

__all__ = ["GiB", "MemoryPlan", "MemoryPlanner", "MemoryTracker"]
