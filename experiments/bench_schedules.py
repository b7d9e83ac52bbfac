"""`make bench-schedules`: every schedule of ours against every torch.distributed.pipelining schedule,
K=2 (the benchmark: :mod:`gpipe_repro.repro.bench_schedules`)."""
import typer

from experiments.command import Budget, MaxRounds, MinRounds, Tolerance
from gpipe_repro.commands.options import int_list
from gpipe_repro.repro import bench_schedules

app = typer.Typer(add_completion=False)


@app.command()
def main(width: int = typer.Option(1024, min=1, help="width of each Linear layer"),
         blocks: int = typer.Option(8, min=4, help="Linear+ReLU layers (a multiple of 4)"),
         batches: str = typer.Option("256,1024", help="mini-batch sizes, comma-separated"),
         ms: str = typer.Option("2,4,8", help="micro-batch counts M, comma-separated"),
         warmup: int = typer.Option(1, min=0, help="untimed steps before the rounds"),
         threads: int = typer.Option(1, min=1, help="torch threads per stage process"),
         smoke: bool = typer.Option(False, help="tiny sizes and rounds to check that everything runs; "
                                    "nothing is written"),
         budget: Budget = 1200.0, tolerance: Tolerance = 0.02, min_rounds: MinRounds = 5,
         max_rounds: MaxRounds = 40) -> None:
    """Our schedules against torch's, K=2 stage processes, best against best."""
    if blocks % 4:
        raise typer.BadParameter("must be a multiple of 4 (2 cells for ours, 4 chunks for torch's looped "
                                 "and V schedules)", param_hint="--blocks")
    bench_schedules.main(width=width, blocks=blocks, batches=int_list("--batches", batches) or [],
                         ms=int_list("--ms", ms) or [], warmup=warmup, threads=threads, smoke=smoke,
                         budget=budget, tolerance=tolerance, min_rounds=min_rounds, max_rounds=max_rounds)


if __name__ == "__main__":
    app()
