"""gpipe-repro: GPipe pipeline-parallel training for PyTorch."""
