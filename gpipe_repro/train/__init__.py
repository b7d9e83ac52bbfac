"""Training runs through the pipeline: one run loop shared by every model family.

- `config.py`: `RunConfig`, the pipeline and bookkeeping settings of a run (K, M, schedule, runtime,
  steps, evaluation / checkpoint cadence, logging);
- `loop.py`: the `Task` interface and `train(task, config)`, THE run loop;
- `ranks.py`: what changes when each cell is its own process (`--runtime distributed`), and `launch`;
- `optim.py`: optimizers (TensorFlow-style RMSProp), learning-rate schedules, label smoothing;
- `instrumentation.py`: per-stage busy/idle fractions and peak memory, sampled;
- `curves.py`: the run's curves and loss comparisons as PNGs;
- `image_classification.py`: the AmoebaNet task and its presets (`cpu`, `paper`, `smoke`);
- `transfer.py`: the transfer-learning protocol of the paper's Table 4.

Nothing is imported here: `gpipe-repro --help` must stay fast; import the module you need.
"""
