"""`make bench-runtime`: the distributed runtime's speedup over K=1, against the ideal and against
torch.distributed.pipelining (the benchmark: :mod:`gpipe_repro.repro.bench_runtime`)."""
import typer

from experiments.command import Budget, MaxRounds, MinRounds, Tolerance, Write
from gpipe_repro.repro import bench_runtime

app = typer.Typer(add_completion=False)


@app.command()
def main(width: int = typer.Option(768, min=1, help="width of each Linear layer"),
         blocks: int = typer.Option(8, min=2, help="Linear+ReLU layers (even: 2 balanced cells)"),
         batch: int = typer.Option(2048, min=16, help="examples per step (M=16 still gets 128 rows)"),
         warmup: int = typer.Option(1, min=0, help="untimed steps before the rounds"),
         threads: int = typer.Option(1, min=1, help="torch threads per stage process"),
         write: Write = True, budget: Budget = 1200.0, tolerance: Tolerance = 0.02,
         min_rounds: MinRounds = 5, max_rounds: MaxRounds = 40) -> None:
    """K=2 stage processes against one process, and against torch.distributed.pipelining."""
    if blocks % 2:
        raise typer.BadParameter("must be even so the two cells are balanced", param_hint="--blocks")
    bench_runtime.main(width=width, blocks=blocks, batch=batch, warmup=warmup, threads=threads, write=write,
                       budget=budget, tolerance=tolerance, min_rounds=min_rounds, max_rounds=max_rounds)


if __name__ == "__main__":
    app()
