"""The GPipe paper's experiments as a library: Tables 1-3, the simulator's validations, the K x R
plans, the GPU check and the bodies of the distributed benchmarks. The `gpipe-repro` commands
(gpipe_repro/commands/) declare their options; the make targets run those commands, or the scripts in
experiments/ for what only a checkout runs (the benchmarks of this engine, the CI baselines, the
training studies)."""
