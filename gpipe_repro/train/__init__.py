"""Training runs through the pipeline: one run loop shared by every model family.

- `config.py`: `RunConfig`, the pipeline and bookkeeping settings of a run (K, M, schedule, runtime,
  steps, evaluation / checkpoint cadence, logging);
- `task.py`: the `Task` interface (what a model family supplies) and its `Batches` stream;
- `loop.py`: `train(task, config)`, THE run loop (it re-exports the names below it used to hold);
- `pipeline.py`: building the `GPipe` for a run, its checkpointed state, pipelined evaluation;
- `summary.py`: `RunSummary` and what a run writes at its end (summary.json/md, curves, W&B);
- `console.py`: the progress bar and the silent stand-ins of non-writing ranks;
- `checkpoints.py`: atomic checkpoints, readable load errors with fallback, resume checks, Ctrl-C;
- `run_dir.py`: where a run writes (fresh `runs/<name>-N`, `--record`, `--out`) and its file manifest;
- `ranks.py`: what changes when each cell is its own process (`--runtime distributed`), and `launch`;
- `optim.py`: optimizers (TensorFlow-style RMSProp), learning-rate schedules, label smoothing;
- `instrumentation.py`: per-stage busy/idle fractions and peak memory, sampled;
- `curves.py`: the run's curves and loss comparisons as PNGs;
- `tasks/image_classification.py`: the AmoebaNet task and its presets (`cpu`, `paper`, `smoke`);
- `tasks/transfer.py`: the transfer-learning protocol of the paper's Table 4;
- `tasks/translation.py`: the multilingual T(L, H, A) translation task.

Nothing is imported here: `gpipe-repro --help` must stay fast; import the module you need.
"""
