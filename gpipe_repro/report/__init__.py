"""How numbers are written and shown: atomic records labelled measured/simulated, provenance (host,
versions, commit, load), W&B, plots and Gantt charts. Depends on the engine only (timelines)."""
