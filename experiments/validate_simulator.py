"""`make validate-sim`: `gpipe-repro validate-sim --record`, the pipeline simulator against real stage
processes (it may replace the results of record)."""
from experiments.command import run

if __name__ == "__main__":
    run("validate-sim", "--record")
