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
The executors run in a :class:`~gpipe_repro.engine.runtime.Runtime` (``pipe.runtime``): the local
one, or the distributed one; this class does not depend on which.

``runtime="distributed"``: one process per cell (``torchrun --nproc-per-node K script.py``, or
:func:`gpipe_repro.distributed.launch_local`). Every process builds the same model and calls
``train_step`` with the same inputs and targets; each keeps only its own cell (``cells[rank]``; the
others are empty placeholders, so ``state_dict()`` holds this rank's weights), runs its stage of the
schedule, and returns the same loss. See :mod:`gpipe_repro.distributed.runtime`.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, overload

import torch
from torch import nn

from gpipe_repro.engine import microbatch
from gpipe_repro.engine.agreement import Agreement, StepConfig, host_value
from gpipe_repro.engine.arguments import (
    as_layers,
    batch_key,
    build_optimizer,
    check_arguments,
    check_auto_split,
    check_batch_first,
    check_materialized,
    check_running_statistics,
    check_sample_target,
    compile_options,
    declared_reduction,
    layer_shapes,
    loss_signature,
    optimizer_signature,
    same_everywhere,
)
from gpipe_repro.engine.batchnorm import (
    BatchStatisticsInEval,
    DeferredBatchNorm,
    check_batchnorms,
    commit_all,
)
from gpipe_repro.engine.foreign import ForeignState, foreign_tensors
from gpipe_repro.engine.layer_costs import cut_layers, layer_costs
from gpipe_repro.engine.loss_scaler import LossScaler, restore_scaler, saved_scaler
from gpipe_repro.engine.losses import CountedCheck, ReductionCheck, exact_mean, loss_weights, own_forward
from gpipe_repro.engine.partition import check_balance
from gpipe_repro.engine.placement import RUNTIMES, move_cell, place_stages, split_cells
from gpipe_repro.engine.runtime import Runtime, build_runtime
from gpipe_repro.engine.schedule import Schedule, gpipe_schedule, make_schedule
from gpipe_repro.engine.split_count import cut_and_split
from gpipe_repro.engine.stage import LossFn, StageExecutor
from gpipe_repro.engine.stand_ins import StandIns
from gpipe_repro.engine.tied import (
    refuse_buffers_across_devices,
    refuse_diverging_copies,
    refuse_hooked_copies,
    refuse_renormalized_copies,
    separate_places,
    tied_names,
    uncounted_names,
    untie,
)
from gpipe_repro.engine.timeline import Timeline

__all__ = ["GPipe", "OptimizerFactory", "RUNTIMES", "as_layers"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class _Unset:
    def __repr__(self) -> str:
        return "<not given>"


_NOT_GIVEN: Any = _Unset()


def _follow_callers_model(pipe: GPipe, *_: Any) -> None:
    """``state_dict``'s pre-hook: the stand-ins up to date with the caller's model first (a function
    of the module it is given, so a deep copy of the pipeline calls it on itself)."""
    pipe._stand_ins.follow()


class GPipe(nn.Module):
    """Pipeline-parallel training of a sequence of layers (see the module docstring).

    A step equals full-batch training of the same layers (same loss, same gradients, same update)
    whatever K, M, the cut, the checkpoint mode or the runtime, under the rules of docs/design.md
    (dropout masks a function of (seed, step, layer, micro-batch), so with dropout a step depends
    on M; BatchNorm normalizes per micro-batch and commits running statistics once per step; every
    tensor of the input is cut along dim 0 and other layers treat rows independently). Any layer
    may work in place. A step is all-or-nothing: if any action of any stage raises, no parameter,
    optimizer state, BatchNorm statistic or step counter changes (the schedule's AGREE barrier
    comes before every update).

    Args:
        layers: the model as an ``nn.Sequential`` or a list of modules, run in order. Layers
            exchange a tensor or a tuple of tensors and plain values (a plain value a function of
            the input's shapes: the distributed runtime fixes it). A parameter tied across cells is
            one identical copy per cell, and a module object given at several places one module per
            place holding the same weights (:mod:`~.engine.tied`).
        partitions: K, the number of stages (cells), 1 <= K <= number of layers.
        micro_batches: M, the number of micro-batches each mini-batch is split into
            (``torch.tensor_split``: sizes differ by at most one); needs M <= the batch size.
        checkpoint: re-materialization: "always", "except_last" (default) or "never".
        balance: the number of layers per cell; default: the partitioner on `cost`.
        cost: per-layer cost for the partitioner: "params", "flops", "time", "activations" (the last
            three need `sample`), or a list of floats. Default: "time" with a `sample`, else "params".
            "time" times each layer on the first cell's device (``devices[0]``, or where the
            layers' parameters are).
        sample: an input batch for measured costs (never modified): one micro-batch's worth.
        sample_target: the targets of `sample` (what ``train_step`` takes as `targets`): with it and
            `loss_fn`, the last layer's measured cost ("time", "flops") includes the loss's forward
            and backward, as the last cell runs them (other costs refuse it; `balance` ignores
            both). Give it for a language model: the
            cross-entropy over the vocabulary is a large share of the head's cost, and a cut
            without it leaves the last cell too many layers.
        objective: the partitioner's objective: "bottleneck", "variance", "greedy" or "equal".
        devices: one device per cell (default: where each cell's parameters are).
        loss_fn: ``loss_fn(output, targets)`` of one micro-batch: a 0-dim tensor, or ``(sum, count)``
            (a summed loss and what it counts, e.g. non-padding tokens): then the mini-batch loss is
            sum of sums / sum of counts, exactly a token-mean over the whole mini-batch. A
            ``reduction="mean"`` ``nn.CrossEntropyLoss`` or ``nn.NLLLoss`` divides by the weight of
            the targets that count (``ignore_index``, ``weight=``), not by the rows: each micro-batch
            sums it and the sums are divided by the whole mini-batch's denominator
            (:mod:`gpipe_repro.engine.losses`). A loss may hold no trainable
            parameter (no cell's optimizer would update it): put a learned temperature in the last
            layer.
        loss_reduction: "mean" or "sum": how micro-batch losses combine (weights n_m/N or 1). Read
            from ``loss_fn.reduction`` when the loss has one; giving a different value is an error.
            Default "mean". Ignored for ``(sum, count)`` losses.
        optimizer: ``params -> torch.optim.Optimizer``, called once per cell. Pass None explicitly
            to compute gradients without updating; leaving it out makes ``train_step`` an error.
        clip_grad_norm: clip the global L2 norm of all cells' gradients to this value before the
            update, as ``torch.nn.utils.clip_grad_norm_`` on the whole model would; None: no clipping.
        precision: "fp32" (default), "bf16" or "fp16": each cell runs under ``torch.autocast`` with
            that dtype, parameters and optimizer states stay fp32, boundary values cross as computed
            (what plain autocast gives the next layer). "fp16" adds a dynamic loss scale
            (GradScaler's rule): if any gradient of any cell is not finite, no cell updates and the
            scale halves.
        low_precision_boundaries: under bf16/fp16, every floating boundary value crosses in that
            dtype: half the bytes sent, and kept for the backward, where a cell's output is fp32 (a
            residual stream autocast keeps in fp32); the next cell's fp32 ops (a norm) then see a
            rounded input, so training differs from plain autocast by about as much as the low dtype
            differs from fp32. Default False: equal to plain autocast.
        schedule: "gpipe" (fill-drain), "1f1b", "zb-h1" (zero bubble), "interleaved"
            (interleaved 1F1B: `partitions` = K*v cells, v=2 per process round robin; with
            runtime="distributed" the job has partitions/2 processes per replica, each running its
            2 cells; M must be a multiple of K; replicas are refused), or "zb-v" and "dualpipe-v"
            (zero bubble on 2 cells per process placed in a V; dualpipe-v needs M >= partitions).
        recompute_ahead: put each recomputation before the wait for its gradient.
        split_backwards: for the zero-bubble schedules ("zb-h1", "zb-v", "dualpipe-v"), how many of
            the last micro-batches split their backward into input and weight gradients; the
            others run it whole where their input gradient would run. None (default): every one,
            as the papers write the schedules. The split's weight gradients fill the cool-down's
            bubble, which the last micro-batches' do; each split costs some Python per deferred
            layer (:mod:`gpipe_repro.engine.schedule.partial_split`), so on small layers splitting
            the last one or two is faster. "auto" (with `sample`): the count, and the cut unless
            `balance` is given, whose step is shortest when the schedule runs in virtual time on the
            layers' forward, whole and split backward timed on the sample
            (:mod:`gpipe_repro.engine.split_count`; chosen for `micro_batches`, read back as
            ``pipe.split_backwards``; timed on the first cell's device). Not chosen again when
            ``micro_batches`` changes; to resume a run give the cut and count it chose (``balance=``,
            ``split_backwards=``). ``pipe.make_schedule().render()`` draws the result.
        seed: the seed of dropout masks.
        deferred_batchnorm: convert BatchNorm layers to :class:`DeferredBatchNorm`.
        runtime: "local" (all cells in this process) or "distributed" (one process per cell).
        replicas: R, data-parallel replicas of the pipeline (``runtime="distributed"`` only): the job
            has K x R processes, rank = replica * K + stage (:mod:`gpipe_repro.distributed.groups`
            says why). Every rank is given the same global mini-batch; it is cut into R x M
            micro-batches and replica r runs micro-batches r*M .. r*M + M - 1, so a step still equals
            full-batch training of the global mini-batch. Each stage's gradients are summed over its
            R replicas by bucketed all-reduces, each launched as soon as its gradients are final
            during the stage's last backward (overlapping that backward and the drain); AGREE
            (loss, clipping, fp16 overflow, the all-or-nothing commit) spans all K x R ranks. See
            :mod:`gpipe_repro.distributed.data_parallel`.
        batchnorm_stats: with replicas, "per_replica" (default: each replica's DeferredBatchNorm
            commits the statistics of its own slice, so running statistics differ between replicas;
            normalization, gradients and weights do not; an evaluation forward cuts its batch over
            the replicas too, so there a row's output depends on its replica's statistics) or
            "synchronized" (the replicas merge their statistics before committing: running
            statistics of the whole global mini-batch, the same on every replica).
        bucket_cap_mb: with replicas, the largest gradient bucket of one all-reduce, in MB (DDP's
            default, 25).
        compile: ``torch.compile`` each layer: True (its defaults, inductor), a mode string, or a
            dict of its arguments (``{"backend": "aot_eager"}``, ``{"mode": "max-autotune-no-cudagraphs"}``).
            Per layer, not per cell: the engine seeds each layer's dropout masks and checks its
            output between layers. The model's modules are not changed (``state_dict`` keys stay).
            Refused: CUDA graphs (modes "reduce-overhead", "max-autotune", the "cudagraphs"
            backend: a replay overwrites the activations the pipeline keeps alive) and a zero-bubble
            schedule that splits backwards (a compiled layer's backward cannot be split into its
            input and weight halves; ``split_backwards=0`` runs every backward whole and is taken).

    Raises:
        TypeError: `layers` is not a sequence of modules.
        ValueError: any argument out of range or inconsistent (the message says what to change),
            checked before any work starts.
    """

    def __init__(self, layers: nn.Sequential | Sequence[nn.Module], *, partitions: int = 1,
                 micro_batches: int = 1, checkpoint: str = "except_last",
                 balance: Sequence[int] | None = None, cost: str | Sequence[float] | None = None,
                 sample: Any = None, sample_target: Any = None, objective: str = "bottleneck",
                 devices: Sequence[torch.device | str] | None = None, loss_fn: LossFn | None = None,
                 loss_reduction: str | None = None, optimizer: OptimizerFactory | None = _NOT_GIVEN,
                 clip_grad_norm: float | None = None, precision: str = "fp32",
                 schedule: str = "gpipe", recompute_ahead: bool = False,
                 split_backwards: int | str | None = None, seed: int = 0,
                 deferred_batchnorm: bool = True, runtime: str = "local", replicas: int = 1,
                 batchnorm_stats: str = "per_replica", bucket_cap_mb: float = 25.0,
                 compile: bool | str | Mapping[str, Any] = False,
                 low_precision_boundaries: bool = False) -> None:
        super().__init__()
        layer_list = as_layers(layers)
        training_schedule = check_arguments(
            num_layers=len(layer_list), partitions=partitions, micro_batches=micro_batches,
            checkpoint=checkpoint, loss_fn=loss_fn, loss_reduction=loss_reduction,
            clip_grad_norm=clip_grad_norm, precision=precision, schedule=schedule,
            recompute_ahead=recompute_ahead, split_backwards=split_backwards, seed=seed,
            runtime=runtime, objective=objective,
            replicas=replicas, batchnorm_stats=batchnorm_stats, bucket_cap_mb=bucket_cap_mb, devices=devices)
        if deferred_batchnorm:
            check_batchnorms(layer_list)
        check_running_statistics(layer_list, micro_batches, checkpoint)
        check_batch_first(layer_list, micro_batches * replicas)
        compiled = compile_options(compile, training_schedule)
        norms = (isinstance(m, nn.modules.batchnorm._BatchNorm)
                 for layer in layer_list for m in layer.modules())
        if compiled is not None and compiled.get("fullgraph") and deferred_batchnorm and any(norms):
            raise ValueError(f"compile={compile!r} asks for one graph per layer (fullgraph=True), and a "
                             "BatchNorm's statistics are recorded outside the compiled graph (GPipe "
                             "commits them once per step: DeferredBatchNorm): drop fullgraph, or pass "
                             "deferred_batchnorm=False (running statistics then update per micro-batch)")
        self._compile = compile if compiled is not None else None
        placement = place_stages(runtime=runtime, schedule=schedule, partitions=partitions,
                                 checkpoint=checkpoint, replicas=replicas)
        # before any other collective: ranks that differ here would take different paths (and wait
        # on different collectives) or train different steps without a word
        placement.check_same_on_every_rank({
            "partitions": partitions, "micro_batches": micro_batches, "checkpoint": checkpoint,
            "schedule": schedule, "recompute_ahead": recompute_ahead,
            "split_backwards": split_backwards, "balance": None if balance is None else list(balance),
            "seed": seed, "precision": precision, "clip_grad_norm": clip_grad_norm,
            "loss_reduction": loss_reduction, "loss_fn": loss_signature(loss_fn), "objective": objective,
            "cost": cost if cost is None or isinstance(cost, str) else "given per layer",
            "replicas": replicas,
            "batchnorm_stats": batchnorm_stats, "bucket_cap_mb": bucket_cap_mb,
            "compile": same_everywhere(compile), "deferred_batchnorm": deferred_batchnorm,
            "low_precision_boundaries": low_precision_boundaries,
            "layers": layer_shapes(layer_list)}, "arguments")
        measured_loss = check_sample_target(sample, sample_target, loss_fn, cost)
        check_auto_split(split_backwards, sample, cost, balance)
        auto = isinstance(split_backwards, str)        # "auto": check_arguments allows no other string
        if (balance is None or auto) and partitions > 1:
            check_materialized(layer_list)
        # layers are timed ("time", "auto") where the first cell will run
        where = (devices[0] if devices else placement.context.device if placement.context is not None
                 else next((p.device for layer in layer_list for p in layer.parameters()), "cpu"))
        if cost is not None and not isinstance(cost, str):   # a list is checked, cut given or not
            layer_costs(layer_list, cost)
        if auto:   # rank 0's timings choose, as they choose a cut
            if balance is not None:    # a cut given is checked before the timing, as without "auto"
                check_balance(balance, len(layer_list), partitions)
            balance, split_backwards = placement.same_on_every_rank(cut_and_split(
                layer_list, partitions, schedule, micro_batches, checkpoint, recompute_ahead, objective,
                sample, measured_loss, balance, device=where))
        elif balance is None:   # measured costs differ between processes: rank 0's cut wins
            balance = placement.same_on_every_rank(
                [len(layer_list)] if partitions == 1 else
                cut_layers(layer_list, partitions, objective, cost, sample, measured_loss,
                           training_schedule.cut_by_split_costs, device=where))
        check_balance(balance, len(layer_list), partitions)
        balance = [int(n) for n in balance]   # the same on every rank: given alike (checked above),
        # or rank 0's

        given = list(layer_list)
        layer_list = separate_places(layer_list)   # one module object at several places (engine.tied)
        if deferred_batchnorm:
            layer_list = [DeferredBatchNorm.convert(layer) for layer in layer_list]
        cells = split_cells(layer_list, balance)
        self.ties = untie(cells)   # a parameter held by several cells: one copy per cell (engine.tied)
        refuse_renormalized_copies(self.ties, cells)
        # what the cells run in place of the caller's modules and parameters follows them (stand_ins)
        self._stand_ins = StandIns(given, cells)
        if isinstance(layers, nn.Module):
            self._stand_ins.watch(layers)
        tied_originals = self._stand_ins.copies()
        # a state taken between steps holds what the caller changed since (its own optimizer's step)
        self.register_state_dict_pre_hook(_follow_callers_model)
        placement.check_same_weights(cells, self.ties)
        self._eval_batch_statistics = BatchStatisticsInEval(layer_list)
        # runtime="distributed": this process's index in its pipeline: its stage, or with
        # "interleaved" its first stage (it runs stages rank, rank + K, ...: `self.stages_here`).
        self.rank: int | None = placement.rank
        self.replicas, self.replica = replicas, placement.replica   # R, and this process's replica
        self.stages_here = placement.stages_here   # the stages (cells) this process runs
        foreign: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        if placement.context is not None:
            if devices is None:
                devices = [placement.context.device] * partitions
            foreign = foreign_tensors(cells, self.stages_here, balance)
            # This process runs only its own cells; the others' layers are not kept.
            cells = [c if s in self.stages_here else nn.Sequential() for s, c in enumerate(cells)]
            self._stand_ins.keep_only(cells)
        if devices is None:
            devices = [next(iter(c.parameters()), torch.empty(0)).device for c in cells]
        self.devices = [torch.device(d) for d in devices]
        refuse_buffers_across_devices(cells, self.devices)
        self.cells = nn.ModuleList(move_cell(c, d) for c, d in zip(cells, self.devices))
        self.balance = list(balance)
        self.partitions, self.micro_batches = partitions, micro_batches
        # make_schedule's last schedule and what it was built from (rebuilt when any of it changes)
        self._schedule: tuple[tuple[Any, ...], Schedule] | None = None
        self.checkpoint, self.schedule_name, self.recompute_ahead = checkpoint, schedule, recompute_ahead
        assert not isinstance(split_backwards, str)     # "auto" was resolved to a count above
        self.split_backwards: int | None = None if split_backwards is None else int(split_backwards)
        self.loss_fn = loss_fn
        self.loss_reduction = declared_reduction(loss_fn) or loss_reduction or "mean"
        # cross-entropy's mean divides by the weight of the targets that count (engine.losses)
        stage_loss, self._loss_denominator = exact_mean(loss_fn)
        # a loss that declares no reduction is assumed a per-row mean, and one declared by a forward
        # of the user's is taken at its word: both checked during the first step that splits the
        # mini-batch (one micro-batch on one replica is the whole batch: any loss is plain training's)
        declared = declared_reduction(loss_fn)
        if loss_fn is not None and loss_reduction is None and (declared is None or own_forward(loss_fn)):
            stage_loss = ReductionCheck(stage_loss, self._parts, declared=declared)
        if loss_fn is not None and (declared is None or own_forward(loss_fn)) and not \
                type(loss_fn).__module__.startswith("gpipe_repro."):   # this project's are pairs
            stage_loss = CountedCheck(stage_loss)   # a pair it returns is (sum, count): checked
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.precision = precision
        self.low_precision_boundaries = bool(low_precision_boundaries)
        self.loss_scaler = LossScaler(enabled=precision == "fp16")
        self._last_agreement: Agreement | None = None   # the last step's (last_grad_norm, ...)
        self._has_optimizer = optimizer is not _NOT_GIVEN
        factory = None if optimizer is _NOT_GIVEN else optimizer
        # One optimizer per cell; a cell with no parameters (e.g. only activations) has none.
        self.optimizers: list[torch.optim.Optimizer | None] = [
            build_optimizer(factory, c, s, tied_originals) if factory and any(True for _ in c.parameters())
            else None for s, c in enumerate(self.cells)]
        placement.check_same_optimizers([optimizer_signature(o) for o in self.optimizers if o is not None])
        self._stand_ins.updated()     # the cells were moved where they run: their values are the given
        self.seed, self.step = int(seed), 0
        self._forward_calls = 0
        self.last_timeline: Timeline | None = None
        # the executors get their transport from the runtime that runs them
        executors = [
            StageExecutor(self._cell(s), s, partitions, sum(balance[:s]), self.devices[s], None,
                          stage_loss, self.optimizers[s], self.seed,
                          uncounted=uncounted_names(self.ties, s), tied=tied_names(self.ties, s),
                          compile_options=compiled)
            for s in self.stages_here]
        for executor in executors:     # each its own: a process of two stages checks twice a step
            executor.foreign = None if foreign is None else ForeignState(executor.stage, *foreign)
        refuse_diverging_copies(self, self.ties)
        self.runtime: Runtime = build_runtime(placement, executors, self.devices, self.ties,
                                              replicas=replicas, bucket_cap_mb=bucket_cap_mb,
                                              batchnorm_stats=batchnorm_stats)
        self.distributed = placement.plugin is not None

    def train(self, mode: bool = True) -> GPipe:
        """Every cell in training mode (or eval), and the caller's modules that the cells hold a
        stand-in for with them (:meth:`~gpipe_repro.engine.stand_ins.StandIns.set_mode`)."""
        super().train(mode)
        stand_ins = self.__dict__.get("_stand_ins")
        if stand_ins is not None:
            stand_ins.set_mode(mode)
        return self

    def _parts(self) -> int:
        """The micro-batches a mini-batch is split into, over every replica (its loss checks)."""
        return self.micro_batches * self.replicas

    # -- the runtime ------------------------------------------------------------------------------
    @property
    def executors(self) -> list[StageExecutor]:
        """This process's stage executors (every stage's with the local runtime)."""
        return self.runtime.executors

    @property
    def record_timeline(self) -> bool:
        """Record the actions of the next steps and forwards: ``last_timeline`` (every stage's)."""
        return self.runtime.record

    @record_timeline.setter
    def record_timeline(self, record: bool) -> None:
        self.runtime.record = record

    @property
    def loss_scale(self) -> float:
        """fp16's current loss scale (:class:`~gpipe_repro.engine.loss_scaler.LossScaler`); 1 otherwise."""
        return self.loss_scaler.scale

    # -- training ---------------------------------------------------------------------------------
    def make_schedule(self) -> Schedule:
        """The training schedule this pipeline runs (validated by the tests, drawn by ``render()``);
        built once per configuration (a schedule is immutable data)."""
        key = (self.schedule_name, self.partitions, self.micro_batches, self.checkpoint,
               self.recompute_ahead, self.split_backwards)
        if self.split_backwards is not None and self.split_backwards > self.micro_batches:
            raise ValueError(f"split_backwards={self.split_backwards} (pipe.split_backwards, given or chosen "
                             f"by 'auto' for the micro-batches at construction) is more than "
                             f"micro_batches={self.micro_batches}: set pipe.split_backwards to at most "
                             f"{self.micro_batches}, or None (every backward split)")
        if self._schedule is None or self._schedule[0] != key:
            schedule = make_schedule(*key)
            if self._compile is not None:    # a setting changed since construction: checked again
                compile_options(self._compile, schedule)
            self._schedule = (key, schedule)
        return self._schedule[1]

    @overload
    def train_step(self, inputs: Any, targets: Any, *, sync: Literal[True] = ...) -> float: ...
    @overload
    def train_step(self, inputs: Any, targets: Any, *, sync: Literal[False]) -> torch.Tensor: ...

    def train_step(self, inputs: Any, targets: Any, *, sync: bool = True) -> float | torch.Tensor:
        """Run one mini-batch: M micro-batches through the pipeline, one synchronous update per cell.
        Returns the mini-batch loss (mean or sum over examples as `loss_reduction` says, or sum of sums
        / sum of counts for a ``(sum, count)`` loss). All-or-nothing: if it raises, nothing changed.

        `sync`: True returns a float (waiting for the device); False a 0-dim float64 tensor on the
        device, and with fp32/bf16 the step reads nothing back from the device (fp16 reads its
        overflow verdict, a ``(sum, count)`` loss its count: :mod:`gpipe_repro.engine.agreement`), so
        the host queues the next step while this one runs; ``float(loss)`` reads on demand."""
        if self.loss_fn is None:
            raise ValueError("train_step needs a loss_fn: GPipe(..., loss_fn=nn.CrossEntropyLoss())")
        if not self._has_optimizer:
            raise ValueError("train_step needs an optimizer: GPipe(..., optimizer=lambda params: "
                             "torch.optim.SGD(params, lr=0.1)); pass optimizer=None to compute "
                             "gradients without updating")
        refuse_hooked_copies(self.ties, {s: c for s, c in enumerate(self.cells) if s in self.stages_here})
        self._follow_caller()
        # before any work: every rank of a distributed pipeline has the same mini-batch
        self.runtime.check_same_batch((batch_key(inputs, targets), self.micro_batches, self.training))
        mbs, tgts, sizes = microbatch.split_minibatch(inputs, targets, self.micro_batches, self.replicas)
        weights = loss_weights(sizes, tgts, self.loss_reduction, self._loss_denominator)
        if self.replicas > 1:   # this replica's M of the R x M micro-batches; weights stay global
            mine = slice(self.replica * self.micro_batches, (self.replica + 1) * self.micro_batches)
            mbs, tgts, weights = mbs[mine], tgts[mine], weights[mine]
        schedule = self.make_schedule()
        config = StepConfig(self.precision, self.clip_grad_norm, self.loss_scale,
                            count_scale=microbatch.target_count(self.loss_fn, targets)
                            if self.precision == "fp16" else 1.0,
                            low_precision_boundaries=self.low_precision_boundaries)
        for e in self.runtime.executors:   # the optimizers as they are now (one may have been replaced)
            e.optimizer = self.optimizers[e.stage]
        agreement = self.runtime.train_step(schedule, self.step, mbs, tgts, weights, config)
        self._stand_ins.updated()
        self.last_timeline = self.runtime.last_timeline
        self.step += 1
        self._last_agreement = agreement
        self.loss_scaler.update(agreement.skipped)   # read only under fp16
        return host_value(agreement.loss) if sync else agreement.loss

    def _follow_caller(self) -> None:
        """Before a step or a forward: the stand-ins take what the caller changed in its own modules
        since; a tied weight's later copy changed on its own is refused (the local runtime: the
        distributed one compares the copies at its gradient all-reduce)."""
        if self.rank is None:
            self._stand_ins.refuse_changed_copies()
        self._stand_ins.follow()

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (with clipping or fp16; else None).
        Reading it waits for the device (once)."""
        agreement = self._last_agreement
        if agreement is None or agreement.grad_norm is None:
            return None
        return host_value(agreement.grad_norm)

    @property
    def last_step_skipped(self) -> bool:
        """fp16: whether the last step overflowed and was skipped (no cell updated)."""
        return self._last_agreement is not None and self._last_agreement.skipped()

    @torch.no_grad()
    def forward(self, inputs: Any) -> Any:
        """Pipelined inference: the whole batch's output (on the last cell's device; with
        runtime="distributed", on every rank), no gradient. Use :meth:`train_step` to train.

        In eval mode (the pipeline's, or every layer's: ``model.eval()`` reaches them) the output
        does not depend on M, so a batch smaller than M (the last batch of an epoch, one sentence
        to decode) runs as min(M, N) micro-batches; a BatchNorm that normalizes by its batch there
        (no running statistics, or left in training mode) makes it one. In training mode the
        output depends on M (BatchNorm normalizes per micro-batch), so, as for ``train_step``, a batch
        smaller than M is an error; each call draws fresh dropout masks."""
        n = microbatch.batch_size(inputs)
        if n == 0:
            raise ValueError("the batch is empty (dim 0 has size 0): pipe(x) needs at least one example")
        self._follow_caller()
        # before any work: every rank of a distributed pipeline has the same batch
        self.runtime.check_same_batch((batch_key(inputs, None), self.micro_batches, self.training),
                                      call="forward")
        if self.replicas > 1:   # each replica infers on its slice; the outputs are joined in order
            if n < self.replicas:
                raise ValueError(f"a batch of {n} cannot be shared by replicas={self.replicas}: give "
                                 f"at least {self.replicas} examples")
            inputs = microbatch.split(inputs, self.replicas)[self.replica]
            n = microbatch.batch_size(inputs)
        # the layers' own modes decide (model.eval() reaches them without pipe.eval()); each process
        # reads its own cells', and the processes of a distributed pipeline take one answer
        here = [mod for cell in self.cells for layer in cell.children() for mod in layer.modules()]
        drawing, adapting = self.runtime.any_process([
            any(mod.training for mod in here), BatchStatisticsInEval.adapting(here)])
        training = self.training and drawing
        m = (self.micro_batches if training else
             self._eval_batch_statistics.microbatches(min(self.micro_batches, n), adapting))
        if m > n:
            raise ValueError(f"micro_batches={m} is larger than the batch size {n} in training mode: "
                             f"use micro_batches <= {n}, a larger batch, or pipe.eval()")
        mbs = microbatch.split(inputs, m)
        schedule = gpipe_schedule(self.partitions, m, training=False)
        # Masks of a forward() call must differ between calls and from every training step's:
        # negative step numbers are never used by train_step. A call with every layer in eval mode
        # draws none, and takes no number (the next call's masks are as without it).
        step = -1 - self._forward_calls
        self._forward_calls += int(drawing)
        out = self.runtime.forward(schedule, step, mbs, StepConfig(
            self.precision, low_precision_boundaries=self.low_precision_boundaries))
        self.last_timeline = self.runtime.last_timeline
        if drawing:     # BatchNorms in training mode took this batch's statistics: one update
            for cell in self.cells:
                commit_all(cell)
        return out

    def _apply(self, fn: Any, recurse: bool = True) -> GPipe:
        """After ``.to()``/``.cuda()``/``.cpu()``, keep `devices` (and the executors) where the cells are."""
        super()._apply(fn, recurse)
        for s, cell in enumerate(self.cells):
            t = next(iter([*cell.parameters(), *cell.buffers()]), None)
            if t is not None:
                self.devices[s] = t.device
        self.runtime.move_to(self.devices)
        return self

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        """``nn.Module.to``; a device given moves every cell there, the device list included."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        super().to(*args, **kwargs)
        if device is not None:
            self.devices[:] = [torch.device(device)] * len(self.devices)
            self.runtime.move_to(self.devices)
        return self

    # -- state ------------------------------------------------------------------------------------
    def _cell(self, s: int) -> nn.Sequential:
        cell = self.cells[s]
        assert isinstance(cell, nn.Sequential)
        return cell

    def unpartitioned(self) -> nn.Sequential:
        """The layers as one nn.Sequential (the same module objects, but for each cell's copy of a
        tied parameter, untied, and a module given at several places, one copy per later place:
        engine.tied); with runtime="distributed", only this rank's layers."""
        return nn.Sequential(*[layer for s in range(len(self.cells)) for layer in self._cell(s)])

    def training_state(self) -> dict[str, Any]:
        """Everything a resumed run needs: weights, buffers, optimizer states, step, seed, the fp16
        loss scale."""
        return {"model": self.state_dict(),
                "optimizers": [None if o is None else o.state_dict() for o in self.optimizers],
                "step": self.step, "seed": self.seed, "balance": self.balance,
                "micro_batches": self.micro_batches, "split_backwards": self.split_backwards,
                "forward_calls": self._forward_calls, **saved_scaler(self.loss_scaler)}

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`training_state` saved (the cut must be the same). A state saved at
        another M loads with a warning: the run goes on correctly, but its dropout masks and
        BatchNorm micro-batches are this M's, so it is not the saved run continued."""
        saved_m = state.get("micro_batches")
        if saved_m is not None and int(saved_m) != self.micro_batches:
            warnings.warn(f"the saved state was trained with micro_batches={saved_m}, this pipeline "
                          f"runs {self.micro_batches}: training goes on, but its dropout masks and "
                          "BatchNorm micro-batches differ from the saved run's (build GPipe with "
                          f"micro_batches={saved_m} to continue it exactly)", stacklevel=2)
        if list(state["balance"]) != self.balance:
            saved = list(state["balance"])
            raise ValueError(f"the saved state was cut as {saved} but this pipeline is "
                             f"{self.balance}: build GPipe with partitions={len(saved)}, "
                             f"balance={saved}")
        self.load_state_dict(state["model"])
        for o, s in zip(self.optimizers, state["optimizers"]):
            if o is not None:
                o.load_state_dict(s)
        self.step, self.seed = int(state["step"]), int(state["seed"])
        restore_scaler(self.loss_scaler, state)
        self._forward_calls = int(state.get("forward_calls", 0))
        self.runtime.reseed(self.seed)
