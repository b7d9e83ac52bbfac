"""`make replicas-plan-table`: `gpipe-repro replicas-plan-table --record`, K x R x M for Transformer-L and
AmoebaNet-D on 8 to 2048 devices (simulated)."""
from experiments.command import run

if __name__ == "__main__":
    run("replicas-plan-table", "--record")
