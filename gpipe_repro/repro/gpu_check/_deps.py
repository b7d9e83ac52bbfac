"""Every piece of the project gpu-check uses, imported in one place.

gpu-check reads the engine, the memory planner, the calibration, the simulator and the report
helpers without changing them. Some of those modules are being reorganized (the calibration may
become a package): when a name moves, this file is the only one to edit.
"""
from __future__ import annotations

from gpipe_repro import paper
from gpipe_repro.engine import boundary
from gpipe_repro.engine.batchnorm import DeferredBatchNorm
from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.engine.microbatch import split_sizes
from gpipe_repro.engine.partition import partition
from gpipe_repro.engine.schedule import Action, make_schedule
from gpipe_repro.engine.stage import StageExecutor
from gpipe_repro.memory.planner import MemoryPlanner
from gpipe_repro.memory.profile import ProfileCache, rmsprop_foreach
from gpipe_repro.memory.search import largest, transformer_runs
from gpipe_repro.memory.trace import prime_optimizer
from gpipe_repro.memory.tracker import MemoryTracker
from gpipe_repro.memory.workloads import workload as memory_workload
from gpipe_repro.models.hf_gpt2 import gpt2_config, gpt2_layers
from gpipe_repro.models.transformer_lm import lm_loss, transformer_lm
from gpipe_repro.report.provenance import environment
from gpipe_repro.report.records import (
           atomic_write,
           markdown_table,
           measured,
           simulated,
           write_json,
           write_markdown,
)
from gpipe_repro.sim.calibration import (
           DEVICES,
           Calibration,
           Workload,
           calibrate,
           materialize,
           materialize_value,
)
from gpipe_repro.sim.links import PRESETS, LinkModel
from gpipe_repro.sim.simulator import simulate_config

__all__ = ["paper", "atomic_write", "boundary", "materialize_value", "DeferredBatchNorm", "GPipe",
           "split_sizes", "partition", "Action", "make_schedule",
           "StageExecutor", "MemoryPlanner", "ProfileCache", "rmsprop_foreach", "largest",
           "transformer_runs", "prime_optimizer", "MemoryTracker", "memory_workload", "gpt2_config",
           "gpt2_layers", "lm_loss", "transformer_lm", "environment", "markdown_table", "measured",
           "simulated", "write_json", "write_markdown", "DEVICES", "Calibration", "Workload",
           "calibrate", "materialize", "PRESETS", "LinkModel", "simulate_config"]
