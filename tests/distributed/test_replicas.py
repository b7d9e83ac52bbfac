"""R replicas of a K-stage pipeline (K x R processes) train exactly like plain full-batch training.

Each rank compares ITS cell's losses, gradients and updated weights after two steps (the first agrees
on boundary specs, the second runs with receives posted early) with :func:`tests.equivalence.
reference_train` (which imports no engine code) run on the GLOBAL mini-batch of 11 examples cut into
R x M micro-batches (uneven sizes), with dropout, every checkpoint mode, global gradient clipping and
BatchNorm. Many configurations share one launch to keep the test fast (4 processes on 2 cores);
each rank returns what it checked so that a vacuous pass is caught. K = 3 x R = 1 is
tests/distributed/test_equivalence.py (the same code path: one replica).
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.distributed import JobFailed, launch_local
from gpipe_repro.distributed.groups import Layout
from tests.engine.test_equivalence import MODELS, data
from tests.equivalence import ATOL, RTOL, reference_train, sgd

# (model, micro-batches per replica, checkpoint, extra GPipe arguments); batches have 11 examples.
CONFIGS: dict[tuple[int, int], list[tuple[str, int, str, dict[str, Any]]]] = {
    (2, 2): [("mlp", 2, "always", {}), ("mlp", 1, "never", {"clip_grad_norm": 0.05}),
             ("transformer", 2, "except_last", {}),
             ("conv", 2, "always", {"batchnorm_stats": "synchronized"}),
             ("conv", 1, "never", {}), ("mlp", 2, "except_last", {"schedule": "1f1b"})],
    (1, 2): [("mlp", 3, "except_last", {"clip_grad_norm": 0.05, "bucket_cap_mb": 1e-4}),
             ("transformer", 1, "always", {}),
             ("conv", 2, "never", {"batchnorm_stats": "synchronized"})],
}
STEPS = 2


def _model(kind: str) -> Any:
    return MODELS[kind]


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_replicas(k: int, r: int) -> list[str]:
    """Runs in every process: train each configuration with GPipe(replicas=r) and with the plain
    reference, compare this rank's cell. Returns the configurations checked."""
    checked = []
    groups = set()        # pipelines of one layout share its process groups (no leak per pipeline)
    for kind, m, mode, extra in CONFIGS[(k, r)]:
        build, loss_fn = _model(kind)
        x, y = data(kind)
        where = f"{kind} K={k} R={r} M={m} checkpoint={mode} {extra}"
        pipe = GPipe(build(), partitions=k, micro_batches=m, checkpoint=mode, loss_fn=loss_fn,
                     optimizer=sgd, runtime="distributed", replicas=r, **extra)
        assert pipe.rank is not None
        assert pipe.rank + pipe.replica * k == int(os.environ["RANK"]), "rank = replica * K + stage"
        ref = build()
        ref_losses = reference_train(ref, [(x, y)] * STEPS, loss_fn, micro_batches=r * m,
                                     clip_grad_norm=extra.get("clip_grad_norm"))
        losses = [pipe.train_step(x, y) for _ in range(STEPS)]
        _close(torch.tensor(losses), torch.tensor(ref_losses), f"{where}: losses vs reference")
        first = sum(pipe.balance[:pipe.rank])
        mine = list(pipe._cell(pipe.rank))
        theirs = nn.Sequential(*list(ref)[first:first + len(mine)])
        for (name, p), q in zip(nn.Sequential(*mine).named_parameters(), theirs.parameters()):
            assert (p.grad is None) == (q.grad is None), f"{where}: grad presence of {name}"
            if p.grad is not None and q.grad is not None:
                _close(p.grad, q.grad, f"{where}: grad of {name} vs reference")
            _close(p.detach(), q.detach(), f"{where}: {name} vs reference")
        if extra.get("batchnorm_stats") == "synchronized":
            for (name, b), rb in zip(nn.Sequential(*mine).named_buffers(), theirs.buffers()):
                _close(b.float(), rb.float(), f"{where}: buffer {name} vs reference")
        if "bucket_cap_mb" in extra:   # one bucket per parameter: some leave during the backward
            reducer = pipe.runtime.reducer
            assert reducer is not None and len(reducer.buckets) > 1 and reducer.launched_early > 0, \
                f"{where}: no bucket was launched during the last backward"
        if "clip_grad_norm" in extra:
            assert pipe.last_grad_norm is not None and pipe.last_grad_norm > extra["clip_grad_norm"], \
                f"{where}: clipping was not exercised"
        pipe.eval()
        out = pipe.forward(x)
        assert microbatch_rows(out) == 11, f"{where}: inference returns the whole batch"
        checked.append(where)
        groups.add(id(pipe.runtime.groups))
    assert len(groups) == 1, f"{len(groups)} sets of process groups for one layout"
    if k > 1:
        checked.append(check_allreduce_overlaps_the_drain(k, r))
    else:
        checked.append(check_overflow_on_one_replica_skips_everywhere(r))
    return checked


def check_overflow_on_one_replica_skips_everywhere(r: int) -> str:
    """fp16: only the last replica's slice overflows; no replica updates, every loss scale halves."""
    build, loss_fn = _model("mlp")
    x, y = data("mlp")
    x[-3:] *= 1e6   # rows of the last replica's slice only
    pipe = GPipe(build(), partitions=1, micro_batches=1, loss_fn=loss_fn, optimizer=sgd,
                 runtime="distributed", replicas=r, precision="fp16")
    before = [p.detach().clone() for p in pipe.parameters()]
    scale = pipe.loss_scale
    pipe.train_step(x, y)
    assert pipe.last_step_skipped and pipe.loss_scale == scale / 2, "the overflow was global"
    assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters())), "no replica updated"
    return "fp16 overflow"


def check_allreduce_overlaps_the_drain(k: int, r: int) -> str:
    """The merged timeline has one row per rank and an "allreduce" event on each; the last stage's
    all-reduce is launched before stage 0's last backward starts (causality, not a wall-clock
    threshold: stage 0's last backward needs the gradient the last stage sends after launching it)."""
    build, loss_fn = _model("mlp")
    x, y = data("mlp")
    pipe = GPipe(build(), partitions=k, micro_batches=2, loss_fn=loss_fn, optimizer=sgd,
                 runtime="distributed", replicas=r)
    pipe.record_timeline = True
    pipe.train_step(x, y)
    tl = pipe.last_timeline
    assert tl is not None and tl.num_stages == k * r and tl.meta["replicas"] == r
    launched = {e.stage: e.start for e in tl.events if e.kind == "allreduce"}
    assert sorted(launched) == list(range(k * r)), "one all-reduce per rank"
    for replica in range(r):
        first, last = replica * k, replica * k + k - 1
        last_backward_0 = max(e.start for e in tl.events if e.stage == first and e.kind == "backward")
        assert launched[last] < last_backward_0, "the last stage's all-reduce overlaps the drain"
    return "timeline"


def microbatch_rows(value: Any) -> int:
    return value.shape[0] if isinstance(value, torch.Tensor) else value[0].shape[0]


@pytest.mark.parametrize("k,r", [(2, 2), (1, 2)])
def test_replicated_pipeline_trains_like_full_batch(k: int, r: int) -> None:
    results = launch_local(check_replicas, k * r, k, r, timeout=30)
    expected = len(CONFIGS[(k, r)]) + 1
    assert len(results) == k * r and all(len(res) == expected for res in results)


def test_layout_rank_is_replica_times_k_plus_stage() -> None:
    layout = Layout(3, 2)
    assert layout.pipeline_ranks(1) == [3, 4, 5]
    assert layout.data_parallel_ranks(2) == [2, 5]
    assert [(layout.replica_of(q), layout.stage_of(q)) for q in (0, 4)] == [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match="not a multiple of partitions=2"):
        Layout.for_world(5, 2, 2)
    with pytest.raises(ValueError, match="pass replicas=3"):
        Layout.for_world(6, 2, 2)


def test_replicas_with_the_local_runtime_are_refused() -> None:
    build, loss_fn = _model("mlp")
    with pytest.raises(ValueError, match="replicas=2 needs runtime='distributed'"):
        GPipe(build(), partitions=2, replicas=2, loss_fn=loss_fn, optimizer=sgd)
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        GPipe(build(), partitions=2, replicas=0, loss_fn=loss_fn, optimizer=sgd)


def build_on_wrong_world(k: int, r: int) -> None:
    build, loss_fn = _model("mlp")
    GPipe(build(), partitions=k, replicas=r, loss_fn=loss_fn, optimizer=sgd, runtime="distributed")


@pytest.mark.parametrize("k,r,message", [(2, 1, "not a multiple of 2"), (1, 2, "pass replicas=3")])
def test_world_size_must_be_k_times_r(k: int, r: int, message: str) -> None:
    with pytest.raises(JobFailed, match=message):
        launch_local(build_on_wrong_world, 3, k, r, timeout=10)


def train_with_rank_dependent_batch() -> float:
    build, loss_fn = _model("mlp")
    x, y = data("mlp", n=11 + int(os.environ["RANK"]) // 2)   # replica 1 gets a bigger batch
    pipe = GPipe(build(), partitions=2, micro_batches=2, loss_fn=loss_fn, optimizer=sgd,
                 runtime="distributed", replicas=2)
    before = [p.detach().clone() for p in pipe.parameters()]
    try:
        return pipe.train_step(x, y)
    finally:
        assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters())), "no update"


def test_replicas_given_different_batches_fail_before_any_work() -> None:
    with pytest.raises(JobFailed, match="different mini-batches"):
        launch_local(train_with_rank_dependent_batch, 4, timeout=10)


def check_reducer_sums_into_its_buckets(steps: int) -> list[str]:
    """Runs on 2 ranks: the GradientReducer alone, over several steps (its buckets are reused and
    the gradients end as views of them). A parameter with a gradient on one replica only gets that
    gradient everywhere; one with none anywhere keeps None; a gradient already in its bucket place
    (accumulated into in place) is not lost; each step's sum is that step's, not the last's."""
    import torch.distributed as dist

    from gpipe_repro.distributed.data_parallel import GradientReducer
    dist.init_process_group("gloo")        # the launcher's environment: rank, world, address
    rank = dist.get_rank()
    a, b, c = (nn.Parameter(torch.zeros(3, 2)) for _ in range(3))
    reducer = GradientReducer([a, b, c], group=None, ranks=[0, 1], rank=rank, timeout_s=30,
                              bucket_cap_mb=1e-5)          # one bucket per parameter
    seen = []
    for step in range(steps):
        for p in (a, b, c):
            p.grad = None
        a.grad = torch.full((3, 2), float(10 * step + rank + 1))         # both replicas
        if rank == 0:
            b.grad = torch.full((3, 2), float(step + 5))                  # replica 0 only
        if step == 2:          # a gradient already in its bucket place, added to in place
            a.grad = reducer._views[reducer._bucket_of[id(a)]][0]
            a.grad.fill_(float(10 * step + rank + 1))
        reducer.arm()
        reducer.start()
        reducer.finish()
        assert torch.equal(a.grad, torch.full((3, 2), float(20 * step + 3))), (step, a.grad)
        assert b.grad is not None and torch.equal(b.grad, torch.full((3, 2), float(step + 5)))
        assert c.grad is None, "no replica had a gradient for c"
        seen.append(f"step {step}")
    dist.destroy_process_group()
    return seen


def test_reducer_sums_into_its_buckets_and_keeps_presence() -> None:
    results = launch_local(check_reducer_sums_into_its_buckets, 2, 3, timeout=30)
    assert results == [["step 0", "step 1", "step 2"]] * 2


def build_with_rank_seeded_weights(k: int, r: int, tie: bool) -> None:
    torch.manual_seed(int(os.environ["RANK"]))          # each rank its own weights
    layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    if tie:
        layers[2].weight = layers[0].weight
    GPipe(layers, partitions=k, micro_batches=2, runtime="distributed", replicas=r,
          loss_fn=nn.CrossEntropyLoss())


@pytest.mark.parametrize("k, r, tie, message", [
    (1, 2, False, r"ranks 0 and 1 hold cell 0's 0.weight with different values"),
    (2, 1, True, r"ranks 0 and 1 hold the tied parameter 0.weight \(cell 0\) with different values"),
])
def test_silent_replicas_and_tied_copies_built_with_different_weights_are_refused(
        k: int, r: int, tie: bool, message: str) -> None:
    """Each rank keeps only its own cells: replicas seeded per rank trained from different weights for
    good (every rank reporting the same loss), and so did the copies of a parameter tied across two
    ranks. Refused at construction on every rank; a K=2 pipeline whose untied cells differ from
    another rank's copy of them is fine (each rank uses only its own)."""
    with pytest.raises(JobFailed, match=message):
        launch_local(build_with_rank_seeded_weights, k * r, k, r, tie, timeout=30)
    launch_local(build_with_rank_seeded_weights, 2, 2, 1, False, timeout=30)


def resume_each_replicas_statistics() -> bool:
    """Runs on K=1 x R=2: train a BatchNorm net two steps (each replica's running statistics its
    own, batchnorm_stats="per_replica"), save the whole state as the training loop does, restore it
    into a fresh pipeline, and check this replica's buffers and next step."""
    from gpipe_repro.train.ranks import gather_training_state, own_part

    build, loss_fn = _model("conv")
    x, y = data("conv", n=12)

    def fresh() -> GPipe:
        torch.manual_seed(0)
        return GPipe(build(), partitions=1, micro_batches=2, loss_fn=loss_fn, optimizer=sgd,
                     runtime="distributed", replicas=2)

    pipe = fresh()
    for _ in range(2):
        pipe.train_step(x, y)
    state = gather_training_state(pipe)
    state = launch_broadcast(state)
    again = fresh()
    again.load_training_state(own_part(state, again))
    mine = {k: v for k, v in pipe.state_dict().items() if "running" in k}
    assert mine and all(torch.equal(v, again.state_dict()[k]) for k, v in mine.items()), pipe.replica
    return pipe.replica == 1 and not all(
        torch.equal(v, state["model"][k]) for k, v in mine.items())    # replica 1's own, restored


def launch_broadcast(state: Any) -> Any:
    """Rank 0's gathered state on every rank (the checkpoint file every rank reads)."""
    import torch.distributed as dist
    box = [state]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def test_silent_a_resume_gave_every_replica_replica_zeros_batchnorm_statistics() -> None:
    """A checkpoint kept replica 0's stages only, so a resumed K x R run loaded replica 0's running
    statistics into every replica (per-replica BatchNorm statistics differ): its evaluation, half
    of which each replica scores with its own, differed from the run it continued (top-5 48.47 for
    48.75 at step 20). Each replica's buffers are saved and restored."""
    assert launch_local(resume_each_replicas_statistics, 2, timeout=60) == [False, True]


def train_then_gather(schedule: str, replicas: int) -> bool:
    """Train a BatchNorm net distributed, then gather the trained layers on rank 0: there they equal
    the plain reference (tests.equivalence.reference_train, no engine code) trained on the whole
    mini-batch in the same micro-batches."""
    from gpipe_repro.distributed.model_state import gather_layers

    build, loss_fn = _model("conv")
    layers = build()
    partitions = 4 if schedule == "zb-v" else 2
    pipe = GPipe(layers, partitions=partitions, micro_batches=2, loss_fn=loss_fn, optimizer=sgd,
                 runtime="distributed", replicas=replicas, schedule=schedule)
    x, y = data("conv", n=12)
    pipe.train_step(x, y)
    if not gather_layers(pipe, layers):
        return False
    reference = build()
    reference_train(reference, [(x, y)], loss_fn, micro_batches=2 * replicas)
    for (name, value), expected in zip(nn.Sequential(*layers).named_parameters(),
                                       nn.Sequential(*reference).parameters()):
        _close(value.detach(), expected.detach(), name)
    return True


@pytest.mark.parametrize("schedule,replicas,processes", [("1f1b", 1, 2), ("zb-v", 1, 2), ("gpipe", 2, 4)])
def test_silent_a_distributed_callers_model_held_other_ranks_layers_untrained(
        schedule: str, replicas: int, processes: int) -> None:
    """With runtime="distributed" the caller's model on rank 0 held its own layers trained and the
    others' at their initial values (a `save_pretrained` there wrote a half-trained model, without
    a word). gather_layers copies every stage's trained values into the caller's layers on rank 0."""
    got = launch_local(train_then_gather, processes, schedule, replicas, timeout=60)
    assert got == [True] + [False] * (processes - 1)


def save_and_restore_two_cells_per_process(schedule: str) -> bool:
    """Two processes holding two cells each: the gathered training state restores every cell's
    weights and optimizer state in a fresh pipeline, whose next step equals the first's."""
    from gpipe_repro.train.ranks import gather_training_state, own_part

    build, loss_fn = _model("mlp")
    x, y = data("mlp", n=12)

    def fresh() -> GPipe:
        return GPipe(build(), partitions=4, micro_batches=2, loss_fn=loss_fn, schedule=schedule,
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), runtime="distributed")

    pipe = fresh()
    pipe.train_step(x, y)
    state = launch_broadcast(gather_training_state(pipe))
    again = fresh()
    again.load_training_state(own_part(state, again))
    assert pipe.train_step(x, y) == again.train_step(x, y)
    return all(torch.equal(v, again.state_dict()[k]) for k, v in pipe.state_dict().items())


@pytest.mark.parametrize("schedule", ["interleaved", "zb-v"])
def test_the_training_state_of_two_cells_per_process_failed_to_gather(schedule: str) -> None:
    """gather_training_state took the cells (4) for the processes (2): an IndexError on rank 0 for
    interleaved and zb-v with runtime='distributed' (the others then waited in their next
    collective)."""
    assert launch_local(save_and_restore_two_cells_per_process, 2, schedule, timeout=60) == [True, True]
