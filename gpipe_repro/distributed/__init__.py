"""Pipeline stages as processes: one process per stage over torch.distributed.

- :mod:`~gpipe_repro.distributed.process_group`: joining the job (backend, device, timeouts, threads);
- :mod:`~gpipe_repro.distributed.transport`: boundary values over point-to-point, specs agreed once;
- :mod:`~gpipe_repro.distributed.runtime`: this rank executes its stage of the schedule;
- :mod:`~gpipe_repro.distributed.clock`: one clock for the merged timeline;
- :mod:`~gpipe_repro.distributed.watchdog` and :mod:`~gpipe_repro.distributed.launcher`: failures end
  the job quickly with the failing rank named; K local processes without torchrun
  (:mod:`~gpipe_repro.distributed.launch_env`: the environment variables between them);
- :mod:`~gpipe_repro.distributed.measure`: step times and a timeline for one configuration;
- :mod:`~gpipe_repro.distributed.model_state`: every stage's trained values in the caller's layers on
  one rank (to save the whole model);
- :mod:`~gpipe_repro.distributed.faults`: deliberate failures, to test all of the above.

Use it through ``GPipe(..., runtime="distributed")`` in a function that every stage process runs::

    def main() -> None:
        pipe = GPipe(build_layers(), partitions=2, micro_batches=8, runtime="distributed", ...)
        for x, y in batches():            # the same inputs and targets on every rank
            loss = pipe.train_step(x, y)  # the same loss on every rank

    if __name__ == "__main__":
        stage_main(main)                  # torchrun --nproc-per-node 2 script.py
        # or, without torchrun: launch_local(main, 2)

Every rank must be given the same inputs and targets (same shapes: only the first stage reads the
inputs and only the last the targets, but every rank derives the boundary shapes from them), as a
torchrun script with deterministic data does. Names here are imported lazily.
"""
from __future__ import annotations

from typing import Any

__all__ = ["launch_local", "JobFailed", "stage_main", "init_distributed", "measure_pipeline", "gather_layers"]

_WHERE = {"launch_local": "launcher", "JobFailed": "launcher", "stage_main": "watchdog",
          "init_distributed": "process_group", "measure_pipeline": "measure", "gather_layers": "model_state"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
