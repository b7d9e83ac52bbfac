"""`GPipe`: the one obvious way to train a sequence of layers with pipeline parallelism.

::

    pipe = GPipe(layers, partitions=4, micro_batches=32, checkpoint="except_last",
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    loss = pipe.train_step(x, y)      # one synchronous update; equals full-batch training

What it does, in order: cut the layers into K cells (`balance`, or the partitioner on per-layer
costs), convert BatchNorm to :class:`~gpipe_repro.engine.batchnorm.DeferredBatchNorm`, build one optimizer
per cell, and for each mini-batch split it into M micro-batches, run the schedule's actions through
one :class:`~gpipe_repro.engine.stage.StageExecutor` per cell, and return the mini-batch loss. Every input is
checked up front, and errors say what to change; a failed step raises before any optimizer update.

``runtime="distributed"``: one process per cell (``torchrun --nproc-per-node K script.py``, or
:func:`gpipe_repro.distributed.launch_local`). Every process builds the same model and calls
``train_step`` with the same inputs and targets; each keeps only its own cell (``cells[rank]``; the
others are empty placeholders, so ``state_dict()`` holds this rank's weights), runs its stage of the
schedule, and returns the same loss. See :mod:`gpipe_repro.distributed.runtime`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine import microbatch
from gpipe_repro.engine.batchnorm import DeferredBatchNorm
from gpipe_repro.engine.layer_costs import layer_costs
from gpipe_repro.engine.local_runtime import LocalTransport, run_local
from gpipe_repro.engine.partition import OBJECTIVES, check_balance, partition
from gpipe_repro.engine.rng import preserved_rng
from gpipe_repro.engine.schedule import CHECKPOINT_MODES, SCHEDULES, Schedule, gpipe_schedule, make_schedule
from gpipe_repro.engine.stage import LossFn, StageExecutor, wall_clock
from gpipe_repro.engine.timeline import Timeline

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
RUNTIMES = ("local", "distributed")
# The distributed runtime lives in a later layer (gpipe_repro.distributed, which imports the engine);
# the engine names it here and loads it only when a user asks for it, as torch loads its backends.
# The module provides init_distributed(), broadcast_object() and StageProcess.
_RUNTIME_PLUGINS = {"distributed": "gpipe_repro.distributed.runtime"}


def _runtime_plugin(runtime: str) -> Any:
    import importlib
    return importlib.import_module(_RUNTIME_PLUGINS[runtime])


def as_layers(layers: nn.Sequential | Sequence[nn.Module]) -> list[nn.Module]:
    """Validate a model given as a sequence of layers and return it as a list."""
    if isinstance(layers, nn.Sequential):
        out = list(layers)
    elif isinstance(layers, (list, tuple)):
        out = list(layers)
    else:
        raise TypeError(f"the model must be an nn.Sequential or a list of nn.Module, got "
                        f"{type(layers).__name__}; wrap its parts in nn.Sequential(...)")
    if not out:
        raise ValueError("the model has no layers")
    seen: dict[int, int] = {}
    for i, layer in enumerate(out):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layer {i} is a {type(layer).__name__}, not an nn.Module")
        if id(layer) in seen:
            raise ValueError(f"layers {seen[id(layer)]} and {i} are the same module object; a pipeline "
                             "runs each layer once per micro-batch, so give each position its own "
                             "module (copy.deepcopy it), or share weights inside one layer")
        seen[id(layer)] = i
    return out


def split_cells(layers: list[nn.Module], balance: Sequence[int]) -> list[nn.Sequential]:
    cells, i = [], 0
    for n in balance:
        cells.append(nn.Sequential(*layers[i:i + n]))
        i += n
    return cells


def _to_device(cell: nn.Module, device: torch.device) -> nn.Module:
    """Move a cell only if some tensor of it is elsewhere (moving is a no-op otherwise, but tracing
    tools that run the engine on fake tensors cannot swap storages)."""
    tensors = [*cell.parameters(), *cell.buffers()]
    return cell if all(t.device == device for t in tensors) else cell.to(device)


def _check_shared_parameters(cells: list[nn.Sequential]) -> None:
    owner: dict[int, int] = {}
    for c, cell in enumerate(cells):
        for name, p in cell.named_parameters(remove_duplicate=False):
            if owner.setdefault(id(p), c) != c:
                raise ValueError(f"parameter {name!r} of cell {c} is shared with cell {owner[id(p)]}; each "
                                 "cell has its own optimizer (and device), so tied weights must live in "
                                 "one cell: choose a balance that keeps the tied layers together, or "
                                 "untie them")


class GPipe(nn.Module):
    """Pipeline-parallel training of a sequence of layers (see the module docstring)."""

    def __init__(self, layers: nn.Sequential | Sequence[nn.Module], partitions: int = 1,
                 micro_batches: int = 1, checkpoint: str = "except_last",
                 balance: Sequence[int] | None = None, cost: str | Sequence[float] = "params",
                 sample: Any = None, objective: str = "bottleneck",
                 devices: Sequence[torch.device | str] | None = None, loss_fn: LossFn | None = None,
                 loss_reduction: str = "mean", optimizer: OptimizerFactory | None = None,
                 schedule: str = "gpipe", recompute_ahead: bool = False, seed: int = 0,
                 deferred_batchnorm: bool = True, runtime: str = "local") -> None:
        super().__init__()
        layer_list = as_layers(layers)
        if not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"partitions must be an integer >= 1, got {partitions!r}")
        if partitions > len(layer_list):
            raise ValueError(f"partitions={partitions} is larger than the number of layers "
                             f"({len(layer_list)}): use partitions <= {len(layer_list)}, or split the "
                             "model into more, smaller layers")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if devices is not None and len(devices) != partitions:
            raise ValueError(f"{len(devices)} devices given for partitions={partitions}: give one device "
                             "per partition")
        context = None
        plugin = _runtime_plugin(runtime) if runtime in _RUNTIME_PLUGINS else None
        if plugin is not None:
            context = plugin.init_distributed()
            if context.world_size != partitions:
                raise ValueError(f"partitions={partitions} but the job has {context.world_size} "
                                 f"processes: start one process per partition (torchrun "
                                 f"--nproc-per-node {partitions}, or launch_local(fn, {partitions}))")
        if balance is None:
            balance = ([len(layer_list)] if partitions == 1 else
                       partition(layer_costs(layer_list, cost, sample), partitions, objective))
            if context is not None:  # measured costs differ between processes: rank 0's cut wins
                balance = plugin.broadcast_object(balance)
        check_balance(balance, len(layer_list), partitions)

        if deferred_batchnorm:
            layer_list = [DeferredBatchNorm.convert(layer) for layer in layer_list]
        cells = split_cells(layer_list, balance)
        _check_shared_parameters(cells)
        self.rank: int | None = None   # this process's stage with runtime="distributed"
        if context is not None:
            self.rank = context.rank
            if devices is None:
                devices = [context.device] * partitions
            # This process runs only its own cell; the others' layers are not kept.
            cells = [c if s == self.rank else nn.Sequential() for s, c in enumerate(cells)]
        if devices is None:
            devices = [next(iter(c.parameters()), torch.empty(0)).device for c in cells]
        self.devices = [torch.device(d) for d in devices]
        self.cells = nn.ModuleList(_to_device(c, d) for c, d in zip(cells, self.devices))
        self.balance = list(balance)
        self.partitions, self.micro_batches = partitions, micro_batches
        self.checkpoint, self.schedule_name, self.recompute_ahead = checkpoint, schedule, recompute_ahead
        self.loss_fn, self.loss_reduction = loss_fn, loss_reduction
        # One optimizer per cell; a cell with no parameters (e.g. only activations) has none.
        self.optimizers: list[torch.optim.Optimizer | None] = [
            optimizer(list(c.parameters())) if optimizer and any(True for _ in c.parameters()) else None
            for c in self.cells]
        self.seed, self.step = int(seed), 0
        self.record_timeline = False
        self.last_timeline: Timeline | None = None
        self._transport = LocalTransport(self.devices)
        firsts = [sum(balance[:i]) for i in range(partitions)]
        stages = range(partitions) if self.rank is None else [self.rank]
        self.executors = [
            StageExecutor(self.cells[s], s, partitions, firsts[s], self.devices[s], self._transport,
                          loss_fn, self.optimizers[s], self.seed)
            for s in stages]
        self.stage_process = None  # runtime="distributed": this rank's StageProcess
        if plugin is not None:
            self.stage_process = plugin.StageProcess(self.executors[0], context)

    # -- training ---------------------------------------------------------------------------------
    def make_schedule(self) -> Schedule:
        return make_schedule(self.schedule_name, self.partitions, self.micro_batches, self.checkpoint,
                             self.recompute_ahead)

    def train_step(self, inputs: Any, targets: Any) -> float:
        """Run one mini-batch: M micro-batches through the pipeline, one synchronous update per cell.
        Returns the mini-batch loss (mean or sum over examples, as `loss_reduction` says)."""
        if self.loss_fn is None:
            raise ValueError("train_step needs a loss_fn: GPipe(..., loss_fn=nn.CrossEntropyLoss())")
        mbs, tgts, sizes = self._split(inputs, targets)
        n = sum(sizes)
        weights = [s / n for s in sizes] if self.loss_reduction == "mean" else [1.0] * len(sizes)
        schedule = self.make_schedule()
        if self.stage_process is not None:
            self.stage_process.record = self.record_timeline
            loss = self.stage_process.train_step(schedule, self.step, mbs, tgts, weights)
            self.last_timeline = self.stage_process.last_timeline
            self.step += 1
            return loss
        self._run(schedule, mbs, tgts, weights)
        self.step += 1
        loss = self.executors[-1].end_step()
        for e in self.executors[:-1]:
            e.end_step()
        assert loss is not None
        return loss

    @torch.no_grad()
    def forward(self, inputs: Any) -> Any:
        """Pipelined inference: the whole batch's output (on the last cell's device; with
        runtime="distributed", on every rank), no gradient. Use :meth:`train_step` to train."""
        n = microbatch.batch_size(inputs)
        m = min(self.micro_batches, n)
        schedule = gpipe_schedule(self.partitions, m, training=False)
        if self.stage_process is not None:
            self.stage_process.record = self.record_timeline
            out = self.stage_process.forward(schedule, self.step, microbatch.split(inputs, m))
            self.last_timeline = self.stage_process.last_timeline
        else:
            self._run(schedule, microbatch.split(inputs, m), None, None)
            last = self.executors[-1]
            out = microbatch.join([last.outputs[i] for i in range(m)])
        if self.training:
            from gpipe_repro.engine.batchnorm import commit_all
            for cell in self.cells:
                commit_all(cell)
        return out

    def _split(self, inputs: Any, targets: Any) -> tuple[list[Any], list[Any], list[int]]:
        n = microbatch.batch_size(inputs)
        if self.micro_batches > n:
            raise ValueError(f"micro_batches={self.micro_batches} is larger than the batch size {n}: "
                             f"use micro_batches <= {n} or a larger batch")
        if targets is not None and microbatch.batch_size(targets) != n:
            raise ValueError(f"targets have batch size {microbatch.batch_size(targets)} but inputs {n}")
        sizes = microbatch.split_sizes(n, self.micro_batches)
        return (microbatch.split(inputs, self.micro_batches),
                microbatch.split(targets, self.micro_batches), sizes)

    def _run(self, schedule: Schedule, mbs: list[Any], tgts: list[Any] | None,
             weights: list[float] | None) -> None:
        clock = wall_clock() if self.record_timeline else None
        for e in self.executors:
            e.clock = clock
            e.begin_step(self.step, schedule, mbs if e.stage == 0 else None,
                         tgts if e.is_last else None, weights if e.is_last else None)
        self._transport.box.clear()
        with preserved_rng(self.devices):
            run_local(schedule, self.executors, self._transport)
        if clock is not None:
            self.last_timeline = Timeline(self.partitions, [ev for e in self.executors for ev in e.events],
                                          {"runtime": "local", "schedule": schedule.name})

    # -- state ------------------------------------------------------------------------------------
    def unpartitioned(self) -> nn.Sequential:
        """The layers as one nn.Sequential (the same module objects, not copies); with
        runtime="distributed", only this rank's layers."""
        return nn.Sequential(*[layer for cell in self.cells for layer in cell])

    def training_state(self) -> dict[str, Any]:
        """Everything a resumed run needs: weights, buffers, optimizer states, step and seed."""
        return {"model": self.state_dict(),
                "optimizers": [None if o is None else o.state_dict() for o in self.optimizers],
                "step": self.step, "seed": self.seed, "balance": self.balance}

    def load_training_state(self, state: dict[str, Any]) -> None:
        if list(state["balance"]) != self.balance:
            raise ValueError(f"the saved state was cut as {state['balance']} but this pipeline is "
                             f"{self.balance}: build GPipe with balance={state['balance']}")
        self.load_state_dict(state["model"])
        for o, s in zip(self.optimizers, state["optimizers"]):
            if o is not None:
                o.load_state_dict(s)
        self.step, self.seed = int(state["step"]), int(state["seed"])
        for e in self.executors:
            e.seed = self.seed
