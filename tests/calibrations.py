"""Calibrations for tests: a real one as if the host ran slower."""
from __future__ import annotations

from dataclasses import fields, replace

from gpipe_repro.sim.calibration import Calibration
from gpipe_repro.sim.calibration.costs import COUNTED, LayerCost

#: What a slower host changes: LayerCost's timed fields (the counts stay).
TIMED = [f.name for f in fields(LayerCost) if f.name not in COUNTED]


def slower(calib: Calibration, factor: float) -> Calibration:
    """`calib` on a host `factor` times slower: every timed cost (and the optimizer call) times
    `factor`."""
    return Calibration(calib.workload, calib.method, calib.device, list(calib.groups),
                       {size: [replace(c, **{n: getattr(c, n) * factor for n in TIMED
                                             if getattr(c, n) is not None}) for c in layers]
                        for size, layers in calib.costs.items()},
                       calib.optimizer_call * factor, dict(calib.uncertainty))
