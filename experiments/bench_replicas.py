"""`make bench-replicas`: K=1 x R=2 data parallel against one process, and a K=2 x R=2 Gantt chart
(the benchmark: :mod:`gpipe_repro.repro.bench_replicas`)."""
import typer

from experiments.command import Budget, MaxRounds, MinRounds, Tolerance, Write
from gpipe_repro.report.host import usable_cores
from gpipe_repro.repro import bench_replicas

app = typer.Typer(add_completion=False)


@app.command()
def main(width: int = typer.Option(1024, min=1, help="width of each Linear layer"),
         depth: int = typer.Option(4, min=1, help="Linear+ReLU layers"),
         batch: int = typer.Option(1024, min=2, help="global mini-batch"),
         m: int = typer.Option(1, "--m", min=1, help="micro-batches per replica"),
         steps: int = typer.Option(4, min=1, help="timed steps per job and round (their median)"),
         warmup: int = typer.Option(2, min=0, help="untimed steps before the rounds"),
         write: Write = True, budget: Budget = 600.0, tolerance: Tolerance = 0.03,
         min_rounds: MinRounds = 5, max_rounds: MaxRounds = 30) -> None:
    """Two data-parallel replicas against one process, with the simulator's K=2 x R=2 step."""
    if usable_cores() < 2:
        raise typer.BadParameter(f"bench-replicas runs 2 processes on one core each; this host has "
                                 f"{usable_cores()} usable core(s)")
    bench_replicas.main(width=width, depth=depth, batch=batch, m=m, steps=steps, warmup=warmup, write=write,
                        budget=budget, tolerance=tolerance, min_rounds=min_rounds, max_rounds=max_rounds)


if __name__ == "__main__":
    app()
