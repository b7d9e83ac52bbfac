"""`make validate-unseen`: `gpipe-repro validate-unseen --record`, the simulator against real runs (K=2) of
models it was never tuned on."""
from experiments.command import run

if __name__ == "__main__":
    run("validate-unseen", "--record")
