"""A K x R job under torchrun: R replicas of a K-stage pipeline, on one host or many.

The script every process of the job runs (``experiments/replicas_job.py``). On two hosts, with
``--nproc-per-node K`` so that each host holds whole pipelines (rank = replica * K + stage, see
:mod:`gpipe_repro.distributed.groups`)::

    # on host A (its address: HOST_A)            # on host B
    torchrun --nnodes 2 --node-rank 0 \\          torchrun --nnodes 2 --node-rank 1 \\
      --nproc-per-node 2 --rdzv-backend c10d \\     --nproc-per-node 2 --rdzv-backend c10d \\
      --rdzv-endpoint HOST_A:29500 \\               --rdzv-endpoint HOST_A:29500 \\
      experiments/replicas_job.py --k 2            experiments/replicas_job.py --k 2

Rehearsed on one host with ``--rdzv-endpoint 127.0.0.1:PORT`` for both (tests/distributed/
test_multinode.py). Every process prints which node and local rank it is, so that a failure report naming
a rank (ours: ``[gpipe-repro] rank R failed``; torchrun's: ``rank: R (local_rank: L)``) also names the
node. ``--kill-rank R --kill-step S`` makes rank R kill itself with SIGKILL at step S (a fault drill).
"""
from __future__ import annotations

import os
import signal
import sys
from types import SimpleNamespace

import torch
import typer
from torch import nn

from gpipe_repro.distributed import stage_main
from gpipe_repro.engine.gpipe import GPipe


def _layers(width: int, depth: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.1)) for _ in range(depth)] + [
        nn.Linear(width, 4)]


def run(args: SimpleNamespace) -> list[float]:
    """Train the toy MLP for ``args.steps`` steps on every rank; return the losses."""
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    replicas = world // args.k
    print(f"[gpipe-repro] rank {rank} = node {os.environ.get('GROUP_RANK', '?')} local rank "
          f"{os.environ.get('LOCAL_RANK', '?')} (stage {rank % args.k} of replica {rank // args.k}, "
          f"K={args.k} x R={replicas})", file=sys.stderr, flush=True)
    pipe = GPipe(_layers(args.width, args.depth), partitions=args.k, replicas=replicas,
                 micro_batches=args.m, loss_fn=nn.CrossEntropyLoss(), runtime="distributed",
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05))
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=g)
        y = torch.randint(0, 4, (args.batch,), generator=g)
        if rank == args.kill_rank and step == args.kill_step:
            if args.stamp:
                import time
                with open(args.stamp, "w") as f:
                    f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        losses.append(pipe.train_step(x, y))
        if rank == 0:   # every rank of every node took part: AGREE spans all K x R ranks
            print(f"step {step} loss {losses[-1]:.6f} over {world} ranks", flush=True)
    return losses


app = typer.Typer(add_completion=False)


@app.command()
def main(k: int = typer.Option(2, "--k", min=1, help="stages per pipeline (K); R = world size / K"),
         m: int = typer.Option(2, "--m", min=1, help="micro-batches per replica (M)"),
         batch: int = typer.Option(16, "--batch-size", min=1, help="global mini-batch size"),
         width: int = typer.Option(16, "--width", min=1, help="width of each layer"),
         depth: int = typer.Option(3, "--depth", min=1, help="layers"),
         steps: int = typer.Option(3, "--steps", min=1, help="training steps"),
         kill_rank: int = typer.Option(-1, "--kill-rank", help="fault drill: this rank kills itself"),
         kill_step: int = typer.Option(1, "--kill-step", help="fault drill: at this step"),
         stamp: str = typer.Option("", "--stamp", help="fault drill: write the kill's wall time here"),
         ) -> None:
    """Every process of the K x R job (under torchrun)."""
    stage_main(run, SimpleNamespace(k=k, m=m, batch=batch, width=width, depth=depth, steps=steps,
                                    kill_rank=kill_rank, kill_step=kill_step, stamp=stamp))


if __name__ == "__main__":
    app()
