"""`make throughput-table`: `gpipe-repro throughput-table --record`, the GPipe paper's Tables 2 and 3
(it may replace the results of record)."""
from experiments.command import run

if __name__ == "__main__":
    run("throughput-table", "--record")
