"""Per-layer costs of a model at each micro-batch size: the simulator's and the partitioner's input.

Why per micro-batch size: a layer's cost per sample is not constant. On one CPU thread a matmul-heavy
layer costs 1.6x more per sample at batch 32 than at 256 (2.3x at 16); on a GPU small batches leave
the device idle. A simulation of M micro-batches must use costs measured at the size those
micro-batches actually have, or it reports speedups no pipeline can reach.

Why every layer where it sits, when the model fits: a layer timed alone keeps its weights and
gradients in the caches; a stage cycling through its layers streams them from memory, and from the
second micro-batch of a step on, each backward adds into existing gradients (a read and a write of
every gradient) where a lone timing writes fresh ones. At small micro-batches both are as large as the
arithmetic: on this project's 2-core host a residual MLP block of width 1024 costs 8.0 ms alone at
32 rows, 12.9 ms timed in sequence, 12.5 ms inside a real stage. So by default the whole model is
built on the device and timed in stage order (:func:`time_model_actions`), as torchgpipe's
``balance_by_time`` and PipeDream's profiler do, and the backward is timed both into fresh and into
existing gradients (``LayerCost.accumulate``; the simulator charges it to every backward of a stage
but its first).

Why one layer per group otherwise: a model too big for the device (the point of pipelining) cannot be
timed whole. A Transformer-48 is 48 copies of one layer shape, an AmoebaNet a dozen distinct cells.
Layers with the same type, module structure, parameter and buffer shapes, input signature and output
signature cost the same, so one is timed and the result shared; a 48-layer Transformer costs one
layer's profiling. To get there without allocating the model, the model is built on the ``meta``
device, the sample's shapes are propagated through it (free), and only one representative per group
is materialized on the real device (re-initialized: timing does not depend on the values). Where the
whole model fits in half the device's free memory it is timed in sequence, else this way
(``calibrate(in_sequence=...)`` chooses explicitly); the FLOP counts are per group either way.

Two sources, as in :mod:`gpipe_repro.engine.layer_costs`:

- ``time``: seconds measured on ``cpu`` or ``cuda`` (trimmed mean of repeats, see
  :func:`robust_seconds`), for each action the schedule runs: FORWARD keeping the graph,
  checkpointed FORWARD (``no_grad``), RECOMPUTE, BACKWARD, and the OPTIMIZER_STEP (committing the
  BatchNorm statistics, updating the parameters). Each forward includes the engine's per-layer RNG
  seeding and BatchNorm is the engine's DeferredBatchNorm, so the costs are those of the stage
  executor. The last layer includes the loss. Measured in the conditions of a running pipeline:
  the thread count the runtime uses (1 per stage process on a CPU host) and, on a CPU, the other
  cores busy training the same model (:func:`busy_neighbours`).
- ``flops``: forward and backward FLOPs (``torch.utils.flop_counter`` on meta tensors: deterministic,
  device-free, seconds even for paper-size models), turned into seconds by a :class:`DeviceModel`.

Repeats: every layer is timed in rounds interleaved across layers, and each cost is the median over
rounds; after the least rounds asked for, more follow (up to ``max_rounds``) while the median layer's
95% interval over rounds is wider than 0.5% of its cost, so that two calibrations on a host whose
speed changes agree within about 1% per layer where the host allows it. What remains is recorded as
the calibration's uncertainty (:meth:`Calibration.uncertainty_at`), and the partition choice treats
cuts within it of the optimum as ties (:mod:`gpipe_repro.sim.partition_choice`).

Timings are cached on disk (``$GPIPE_REPRO_CACHE`` or ``~/.cache/gpipe-repro``), one JSON file per
(workload, device and thread count, micro-batch size, torch version, repeats, calibration version),
so a rerun of an experiment costs nothing and a change of any of those re-measures.

Modules: ``costs`` (the data types), ``shapes`` (meta tracing and groups), ``timing``, ``neighbours``
(measurement conditions) and ``run`` (:func:`calibrate` and its cache). The workload type is
:class:`gpipe_repro.models.workload.Workload`, the device models :mod:`gpipe_repro.sim.devices`.
"""
from __future__ import annotations

from gpipe_repro.models.workload import Workload
from gpipe_repro.sim.cache import cache_dir
from gpipe_repro.sim.calibration.costs import Calibration, LayerCost
from gpipe_repro.sim.calibration.neighbours import busy_neighbours
from gpipe_repro.sim.calibration.run import CALIBRATION_VERSION, METHODS, calibrate, device_description
from gpipe_repro.sim.calibration.shapes import materialize, materialize_value, trace_shapes
from gpipe_repro.sim.calibration.timing import (
    forward_flops,
    make_optimizer,
    optimizer_call_overhead,
    robust_seconds,
    time_layer_actions,
    time_model_actions,
)
from gpipe_repro.sim.devices import DEVICES, DeviceModel

__all__ = ["CALIBRATION_VERSION", "DEVICES", "METHODS", "Calibration", "DeviceModel", "LayerCost",
           "Workload", "busy_neighbours", "cache_dir", "calibrate", "device_description",
           "forward_flops", "make_optimizer", "materialize", "materialize_value",
           "optimizer_call_overhead", "robust_seconds", "time_layer_actions", "time_model_actions",
           "trace_shapes"]
