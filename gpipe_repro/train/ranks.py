"""What the run loop does differently when every cell is its own process (`--runtime distributed`).

The distributed runtime is SPMD: each of the K stage processes runs the whole run loop, builds the
same model from the same seed, reads the same batches and calls `train_step` with them; GPipe keeps
only the process's own cell, and every rank gets the same loss and the same evaluation outputs. With
`--replicas R` the job has K x R processes (rank = replica * K + stage,
`gpipe_repro.distributed.groups`): every rank still reads the whole mini-batch and GPipe gives each
replica its slice and averages the gradients. So the loop is unchanged except for four things, all
here:

- **One writer.** Rank 0 alone logs (W&B, metrics.jsonl), shows the progress bar and writes files.
- **One checkpoint file.** Each rank's `GPipe.training_state()` holds only its cell's weights and
  optimizer (the same on every replica of a stage: replica 0's are kept); they are gathered to rank 0
  and merged into exactly the file a local run writes, so a
  run can be resumed under either runtime and fine-tuned from with any K. On loading, each rank
  keeps its own cell's part.
- **One decision to stop.** Ctrl-C reaches every process of the job (or SIGTERM reaches one): the
  ranks agree after each step (a max all-reduce of the flag), so they all save and stop at the same
  step instead of deadlocking.
- **Memory of every device.** Peak memory is gathered from all ranks and logged per rank.

`launch` starts the job: in this process (local runtime), as K local processes
(`--launcher local`), or inside processes that torchrun started (`--launcher torchrun`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gpipe_repro.engine.gpipe import GPipe
    from gpipe_repro.train.config import RunConfig
    from gpipe_repro.train.loop import RunSummary, Task



def _dist() -> Any:
    import torch.distributed as dist
    return dist


def _group() -> Any:
    from gpipe_repro.distributed.process_group import control_group
    return control_group()


def join(config: RunConfig) -> int | None:
    """Join the job if this is a distributed run (idempotent); this process's rank, else None."""
    if config.runtime != "distributed":
        return None
    from gpipe_repro.distributed.process_group import init_distributed
    # under torchrun nothing else carries --timeout to the process group (launch_local sets it in
    # the environment of the processes it starts)
    return init_distributed(timeout_s=config.timeout, threads=config.threads or 1).rank


def is_writer(rank: int | None) -> bool:
    return rank is None or rank == 0


def gather_training_state(pipe: GPipe) -> dict[str, Any] | None:
    """The whole pipeline's `training_state()` on rank 0 (None elsewhere); local runs: as is.

    Replica 0's stages give the parameters and optimizer states (every replica holds the same);
    each other replica gives its buffers under ``replica_buffers`` (BatchNorm's running statistics
    differ per replica with ``batchnorm_stats="per_replica"``: a resume that gave every replica
    replica 0's evaluated differently from the run it continued)."""
    state = pipe.training_state()
    if pipe.rank is None:
        return state
    from gpipe_repro.engine.boundary import map_tensors
    mine = map_tensors(state, lambda t: t.detach().cpu())
    if pipe.replica > 0:      # the parameters and optimizers are replica 0's: only the buffers
        buffers = {name for name, _ in pipe.named_buffers()}
        mine = {"model": {k: v for k, v in mine["model"].items() if k in buffers}}
    world, rank = _dist().get_world_size(), _dist().get_rank()
    processes = world // pipe.replicas      # per replica: one per cell, or per two (interleaved, V)
    parts: list[Any] = [None] * world if rank == 0 else []
    _dist().gather_object(mine, parts if rank == 0 else None, dst=0, group=_group())
    if rank != 0:
        return None
    first = parts[:processes]                                   # replica 0's processes
    owner = pipe.make_schedule().process_of()                   # the process holding each cell
    merged = dict(first[0])
    merged["model"] = {k: v for part in first for k, v in part["model"].items()}
    merged["optimizers"] = [first[owner[s]]["optimizers"][s] for s in range(pipe.partitions)]
    if pipe.replicas > 1:
        merged["replica_buffers"] = [
            {k: v for part in parts[r * processes:(r + 1) * processes] for k, v in part["model"].items()}
            for r in range(1, pipe.replicas)]
    return merged


def own_part(state: dict[str, Any], pipe: GPipe) -> dict[str, Any]:
    """The part of a whole-pipeline training state that this rank's GPipe holds: its stage's
    parameters and optimizer state, and its replica's own buffers where the state has them."""
    if pipe.rank is None:
        return state
    keys = set(pipe.state_dict())
    model = {k: v for k, v in state["model"].items() if k in keys}
    others = state.get("replica_buffers")
    if pipe.replica > 0 and others is not None and pipe.replica - 1 < len(others):
        model.update({k: v for k, v in others[pipe.replica - 1].items() if k in keys})
    rest = {k: v for k, v in state.items() if k != "replica_buffers"}
    return {**rest, "model": model}


def any_rank(flag: bool, rank: int | None) -> bool:
    """True on every rank if `flag` is true on any (a collective in distributed runs)."""
    if rank is None:
        return flag
    value = torch.tensor([1 if flag else 0])
    _dist().all_reduce(value, op=_dist().ReduceOp.MAX, group=_group())
    return bool(value.item())


def gather_metrics(metrics: dict[str, float], rank: int | None) -> dict[str, float]:
    """Every rank's metrics on rank 0, prefixed `rank{r}/` (local runs: as is)."""
    if rank is None:
        return metrics
    world = _dist().get_world_size()
    parts: list[Any] = [None] * world if rank == 0 else []
    _dist().gather_object(metrics, parts if rank == 0 else None, dst=0, group=_group())
    if rank != 0:
        return {}
    out: dict[str, float] = {}
    for r, part in enumerate(parts):
        for key, value in part.items():
            section, _, name = key.partition("/")
            out[f"{section}/rank{r}_{name}"] = value
    return out


def _train_rank(task_factory: Callable[[], Task], config: RunConfig) -> RunSummary:
    from gpipe_repro.train.loop import train
    return train(task_factory(), config)


def launch(task_factory: Callable[[], Task], config: RunConfig) -> RunSummary:
    """Run the training job `config` describes and return its summary (rank 0's).

    `task_factory` builds the task in the process that trains; for `--launcher local` it is sent to
    K new processes, so it must be picklable (a class and its config, e.g.
    `functools.partial(AmoebaNetTask, settings)`).
    """
    from gpipe_repro.train.loop import train

    if config.runtime == "local":
        return train(task_factory(), config)
    preflight(task_factory, config)
    if config.launcher == "torchrun":
        import os
        if "RANK" not in os.environ:
            raise RuntimeError(f"--launcher torchrun: start the job with torchrun, e.g. `torchrun "
                               f"--nproc-per-node {config.partitions * config.replicas} "
                               "$(which gpipe-repro) run ... "
                               "--runtime distributed --launcher torchrun`; or use --launcher local")
        from gpipe_repro.distributed.watchdog import stage_main
        return stage_main(_train_rank, task_factory, config)
    from gpipe_repro.distributed.launcher import launch_local

    # A SIGINT/SIGTERM to the launcher is passed on to every stage process (they finish the step,
    # save and stop together); the launcher keeps watching them meanwhile (see launch_local).
    results = launch_local(_train_rank, config.partitions * config.replicas, task_factory, config,
                           timeout=config.timeout, threads=config.threads or 1)
    return results[0]


def preflight(task_factory: Callable[[], Task], config: RunConfig) -> None:
    """The checks a distributed run makes once, in the launcher, before any stage process starts:
    K against the model's layers, the run directory, and (with --resume) the checkpoint and its
    settings. A mistake is one clear error here instead of K tracebacks from K processes."""
    from gpipe_repro.train.checkpoints import load_latest_checkpoint
    from gpipe_repro.train.loop import check_resumable
    from gpipe_repro.train.run_dir import check_run_dir

    task = task_factory()
    if config.resume:
        checkpoint, _ = load_latest_checkpoint(config.checkpoint_dir)
        check_resumable(checkpoint["extra"], config, task)
    check_run_dir(config.run_dir, task.name, resume=config.resume, overwrite=config.overwrite)
    try:
        with torch.device("meta"):
            layers = len(task.build_layers())
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta is checked by the ranks
        return
    if config.partitions > layers:
        raise ValueError(f"--k {config.partitions}: the model has {layers} layers, and each of the K cells "
                         f"needs at least one; use --k {layers} or fewer (no process was started)")
    if config.balance is not None and sum(config.balance) != layers:
        raise ValueError(f"balance {config.balance} covers {sum(config.balance)} layers, the model has "
                         f"{layers}")
