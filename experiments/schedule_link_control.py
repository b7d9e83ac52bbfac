"""Why GPipe can beat 1F1B in the schedule ablation: the same FLOP-model row on the TPU link and on a
free link (simulated; docs/schedules.md). The numbers: :func:`gpipe_repro.repro.throughput.schedules.
link_control`."""
import typer

from gpipe_repro.repro.throughput.schedules import link_control

app = typer.Typer(add_completion=False)


@app.command()
def main() -> None:
    """AmoebaNet-D, FLOP model, K=8, M=32, checkpoint never: simulated samples/s per link."""
    result = link_control()
    names = sorted(next(iter(result.values())))
    print("AmoebaNet-D, FLOP model, K=8, M=32, checkpoint never: simulated samples/s")
    print(f"{'link':10s}" + "".join(f"{n:>13s}" for n in names))
    for link, row in result.items():
        print(f"{link:10s}" + "".join(f"{row[n]:13.0f}" for n in names))


if __name__ == "__main__":
    app()
