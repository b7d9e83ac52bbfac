"""The engine as the run loop uses it: building the `GPipe`, its state for checkpoints, pipelined
evaluation, and where inputs go.

In a distributed run each stage process builds only its own cell (`ranks.join` gives the rank); the
checkpointed state is the whole pipeline's, gathered on rank 0 (`PipelineState`).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine import microbatch
from gpipe_repro.engine.boundary import map_tensors, to_device
from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.engine.stage import LossFn
from gpipe_repro.train import ranks
from gpipe_repro.train.config import RunConfig
from gpipe_repro.train.instrumentation import memory_metrics
from gpipe_repro.train.optim import OptimizerConfig, optimizer_factory


def resolve_devices(device: str, partitions: int) -> list[torch.device] | None:
    """One device per cell: None (the layers' device, the CPU) or cuda:(k mod #GPUs)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device "
                           f"(torch {torch.__version__}); use --device cpu")
    count = torch.cuda.device_count()
    return [torch.device("cuda", k % count) for k in range(partitions)]


def first_micro_batch(pair: tuple[Any, Any], config: RunConfig) -> tuple[Any, Any]:
    """The first micro-batch (inputs, targets) of a mini-batch as the run cuts it (R x M pieces):
    what a stage runs, so what the partitioner's measured costs should be taken on."""
    pieces = min(config.micro_batches * config.replicas, microbatch.batch_size(pair[0], "the sample batch"))
    return microbatch.split(pair[0], pieces)[0], microbatch.split(pair[1], pieces)[0]


def build_pipeline(layers: nn.Sequential, config: RunConfig, loss_fn: LossFn, loss_reduction: str,
                   optimizer: OptimizerConfig, sample: Any = None, balance: list[int] | None = None,
                   devices: list[torch.device] | None = None, sample_target: Any = None,
                   split_backwards: int | str | None = None) -> GPipe:
    """The engine: every cell in this process on `devices` (runtime "local"), or this process's cell
    of a job of K x R stage processes (runtime "distributed"; the device is the rank's, see
    `ranks.join`; with R replicas each one trains on its slice of the mini-batch). `balance` and
    `split_backwards` (a resumed run's, as it ran) win over the config's."""
    return GPipe(layers, partitions=config.partitions, micro_batches=config.micro_batches,
                 checkpoint=config.checkpoint, balance=balance or config.balance,
                 cost=config.partition_cost, sample=sample, sample_target=sample_target,
                 objective=config.objective,
                 devices=None if config.runtime == "distributed" else devices, loss_fn=loss_fn,
                 loss_reduction=loss_reduction, optimizer=optimizer_factory(optimizer),
                 schedule=config.schedule, seed=config.seed, runtime=config.runtime,
                 split_backwards=split_backwards if split_backwards is not None else config.split_backwards,
                 precision=config.precision, clip_grad_norm=config.clip_grad_norm,
                 replicas=config.replicas)


class PipelineState:
    """`GPipe.training_state()` under the `state_dict` names `checkpointing.training_state` uses.

    In a distributed run it is the whole pipeline's state, gathered on rank 0 (None on the other
    ranks, which do not write), and each rank loads its own cell's part of it.
    """

    def __init__(self, pipe: GPipe) -> None:
        self.pipe = pipe

    def state_dict(self) -> dict[str, Any] | None:
        return ranks.gather_training_state(self.pipe)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pipe.load_training_state(ranks.own_part(state, self.pipe))


def pipelined_outputs(pipe: GPipe, batches: Iterator[Any]) -> Iterator[Any]:
    """`pipe.forward` over batches in eval mode (training mode restored afterwards). With R replicas
    a batch of fewer than R examples (the last sentences of a language) is repeated up to R rows and
    its own rows' outputs are kept: in eval mode every row's output depends on that row only."""
    was_training = pipe.training
    replicas = getattr(pipe, "replicas", 1)
    pipe.eval()
    try:
        for x in batches:
            n = microbatch.batch_size(x)
            if n >= replicas:
                yield pipe.forward(x)
                continue
            copies = -(-replicas // n)
            out = pipe.forward(map_tensors(x, lambda t, c=copies: torch.cat([t] * c)))
            yield map_tensors(out, lambda t, n=n: t[:n])
    finally:
        pipe.train(was_training)


def place(x: Any, y: Any, pipe: GPipe) -> tuple[Any, Any]:
    """Inputs to the first cell's device, targets to the last cell's (where the loss runs)."""
    return to_device(x, pipe.devices[0]), to_device(y, pipe.devices[-1])


def pipeline_memory(pipe: GPipe) -> dict[str, float]:
    """Peak memory and parameter/optimizer bytes of this process's cells, per device."""
    return memory_metrics(list(pipe.cells), pipe.optimizers, pipe.devices)  # type: ignore[arg-type]
