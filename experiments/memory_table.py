"""`make memory-table`: `gpipe-repro memory-table --record`, the GPipe paper's Table 1 (maximum model
size) from the memory planner (it may replace the results of record)."""
from experiments.command import run

if __name__ == "__main__":
    run("memory-table", "--record")
