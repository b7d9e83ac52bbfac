"""The GPipe paper's experiments as a library (Tables 1-4, deep vs wide, the benchmarks). The scripts in
experiments/ and the `gpipe-repro` commands only choose settings and call these."""
