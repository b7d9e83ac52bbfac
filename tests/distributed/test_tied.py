"""A parameter tied across cells on the distributed runtime: the copies on different processes
(gpipe, interleaved) and on one process (zb-v puts cells 0 and 3 on process 0), fp16, and K=2 x R=2
replicas, train like the plain tied model; the copies are bit-identical across the ranks.

Each rank compares ITS cells' losses, gradients and updated parameters (every name of each) after
two steps with :func:`tests.equivalence.reference_train` (plain PyTorch on the original tied model;
no engine code), then gathers every copy of the tied matrix from every rank and checks they are
equal bit for bit. Several configurations share one launch; each rank returns what it checked.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.distributed import launch_local
from gpipe_repro.distributed.process_group import gather_object
from tests.engine.test_equivalence import lm_loss
from tests.engine.test_repeated_modules import shared_blocks
from tests.engine.test_tied import batches, tied_model
from tests.equivalence import ATOL, RTOL, adam, reference_train, sgd_momentum, tied_copies

# (schedule, partitions, micro-batches per replica, checkpoint, optimizer, extra GPipe arguments)
CONFIGS: dict[int, list[tuple[str, int, int, str, Any, dict[str, Any]]]] = {
    1: [("gpipe", 2, 3, "except_last", adam, {"clip_grad_norm": 0.05}),
        ("interleaved", 4, 2, "never", sgd_momentum, {"clip_grad_norm": 0.05}),
        ("zb-v", 4, 2, "always", adam, {}),
        ("1f1b", 2, 2, "never", sgd_momentum, {"precision": "fp16"})],
    2: [("gpipe", 2, 2, "always", sgd_momentum, {"clip_grad_norm": 0.05})],
}
STEPS = 2
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=max(tol, ATOL), msg=lambda m: f"{what}: {m}")


def check_tied(replicas: int) -> list[str]:
    """Runs in every process: train each configuration, compare this rank's cells with the plain
    tied model, and the tied copies across the ranks."""
    checked = []
    data = batches(steps=STEPS)
    for schedule, k, m, mode, optimizer, extra in CONFIGS[replicas]:
        where = f"{schedule} partitions={k} R={replicas} M={m} {mode} {extra}"
        tol = 1e-4 if "precision" in extra else RTOL
        pipe = GPipe(tied_model(), partitions=k, micro_batches=m, checkpoint=mode, loss_fn=lm_loss,
                     optimizer=optimizer, schedule=schedule, runtime="distributed", replicas=replicas,
                     cost="params", **extra)
        ref = tied_model()
        ref_losses = reference_train(ref, data, lm_loss, micro_batches=replicas * m, optimizer=optimizer,
                                     clip_grad_norm=extra.get("clip_grad_norm"),
                                     autocast=AUTOCAST.get(extra.get("precision", "")))
        losses = [pipe.train_step(x, y) for x, y in data]
        _close(torch.tensor(losses), torch.tensor(ref_losses), f"{where}: losses", tol)
        assert [t.cells for t in pipe.ties] == [[0, k - 1]], f"{where}: the tie spans the first and last cell"
        compared = 0
        for s in pipe.stages_here:
            first = sum(pipe.balance[:s])
            for j, layer in enumerate(pipe.cells[s]):
                for name, p in layer.named_parameters(remove_duplicate=False):
                    q = ref[first + j].get_parameter(name)
                    assert p.grad is not None and q.grad is not None, f"{where}: grad of {name}"
                    _close(p.grad, q.grad, f"{where}: grad of layer {first + j} {name}", tol)
                    _close(p.detach(), q.detach(), f"{where}: layer {first + j} {name}", tol)
                    compared += 1
        assert compared, f"{where}: nothing compared"
        if "clip_grad_norm" in extra:
            assert pipe.last_grad_norm is not None and pipe.last_grad_norm > extra["clip_grad_norm"]
        mine = [(p.detach().clone(), p.grad.clone() if p.grad is not None else None)
                for copies in tied_copies(pipe) for p in copies]
        everyone = [c for rank in gather_object(mine) for c in rank]
        assert len(everyone) == 2 * replicas, f"{where}: {len(everyone)} copies over the job"
        for value, grad in everyone[1:]:
            assert torch.equal(value, everyone[0][0]), f"{where}: tied copies differ between ranks"
            assert grad is not None and torch.equal(grad, everyone[0][1]), f"{where}: copies' gradients"
        checked.append(where)
    return checked


def test_tied_parameters_across_processes_train_like_the_plain_model() -> None:
    results = launch_local(check_tied, 2, 1, timeout=30)
    assert len(results) == 2 and all(len(r) == len(CONFIGS[1]) for r in results)


def test_tied_parameters_with_replicas_train_like_the_plain_model() -> None:
    results = launch_local(check_tied, 4, 2, timeout=30)
    assert len(results) == 4 and all(len(r) == len(CONFIGS[2]) for r in results)


def check_repeated() -> list[str]:
    """Runs in every process: one block object at three places (tests.engine.test_repeated_modules),
    its places on both processes, against plain PyTorch on the same layers."""
    checked = []
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]
    for schedule, k in (("gpipe", 2), ("zb-v", 4)):
        pipe = GPipe(shared_blocks(), partitions=k, micro_batches=2, loss_fn=nn.MSELoss(), optimizer=adam,
                     schedule=schedule, runtime="distributed", cost="params")
        ref = shared_blocks()
        ref_losses = reference_train(ref, data, nn.MSELoss(), micro_batches=2, optimizer=adam)
        losses = [pipe.train_step(x, y) for x, y in data]
        _close(torch.tensor(losses), torch.tensor(ref_losses), f"{schedule}: losses", RTOL)
        for s in pipe.stages_here:
            first = sum(pipe.balance[:s])
            for j, layer in enumerate(pipe.cells[s]):
                for name, p in layer.named_parameters():
                    _close(p.detach(), ref[first + j].get_parameter(name).detach(),
                           f"{schedule}: layer {first + j} {name}", RTOL)
        checked.append(schedule)
    return checked


def test_one_module_at_places_on_two_processes_trains_like_plain_pytorch() -> None:
    assert launch_local(check_repeated, 2, timeout=30) == [["gpipe", "zb-v"]] * 2


def test_every_rank_builds_the_same_tie_groups() -> None:
    """The groups are a function of the ties and the layout alone (the same list on every rank)."""
    from gpipe_repro.distributed.groups import Layout
    from gpipe_repro.distributed.tied import tie_ranks
    from gpipe_repro.engine.tied import untie
    layers = tied_model()
    (tie,) = untie([nn.Sequential(*layers[:2]), nn.Sequential(*layers[2:])])
    layout = Layout(2, 2)
    assert [tie_ranks(tie, layout, [0, 1], r) for r in range(2)] == [[0, 1], [2, 3]]
    assert tie_ranks(tie, layout, [0, 0], 1) == [2]   # both cells on one process: no collective


def check_copies_changed_between_steps(replicas: int) -> list[str]:
    """Runs in every process: a tied copy (K=2) or a replica's parameters (K=1 x R=2) changed in place
    between steps on rank 1 only, then alike on every rank; and the ranks given different learning
    rates. Returns what each case raised ("" where it trained)."""
    import torch.distributed as dist
    data = batches(steps=3)
    seen = []

    def pipe_with(lr: float) -> GPipe:
        return GPipe(tied_model(), partitions=2 // replicas, micro_batches=2, loss_fn=lm_loss,
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=lr), runtime="distributed",
                     replicas=replicas, cost="params")

    for change in ("one rank", "every rank"):
        pipe = pipe_with(0.1)
        pipe.train_step(*data[0])
        rank = dist.get_rank()
        if change == "every rank" or rank == 1:
            with torch.no_grad():   # the tie's copy here (K=2), a replicated parameter (K=1 x R=2)
                (tied_copies(pipe)[0][0] if replicas == 1 else next(pipe.parameters())).mul_(1.5)
        before = [p.detach().clone() for p in pipe.parameters()]
        try:
            pipe.train_step(*data[1])
            seen.append("")
        except ValueError as e:
            seen.append(str(e))
            assert all(torch.equal(p, q) for p, q in zip(pipe.parameters(), before)), "refused, updated"
    try:
        pipe_with(0.1 * (1 + rank))
        seen.append("")
    except ValueError as e:
        seen.append(str(e))
    try:
        GPipe(tied_model(), partitions=2 // replicas, loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1 * rank),
              optimizer=None, runtime="distributed", replicas=replicas, cost="params")
        seen.append("")
    except ValueError as e:
        seen.append(str(e))
    return seen


def test_silent_drift_a_copy_changed_on_one_rank_between_steps_trained_on() -> None:
    """A tied copy or a replica's parameter changed in place on one rank between steps (or loaded by
    load_state_dict there) trained on, the copies 1.7 apart after two steps, silently: the local
    runtime refused such a step, the distributed one compared weights only when built. Each
    all-reduce now carries a flag for a copy changed in place since the last update, and where one
    was, the copies are compared and the step refused before any update, on every rank holding one;
    a change made alike everywhere trains. Ranks given different learning rates (a replica drifting
    with each update) and different losses are refused when built."""
    for replicas in (1, 2):
        for seen in launch_local(check_copies_changed_between_steps, 2, replicas, timeout=60):
            one, every, rates, losses = seen
            assert "differ" in one and "refused before any update" in one, one
            assert every == "", every
            assert "different optimizers (lr 0.1 on rank 0, 0.2 on rank 1)" in rates, rates
            assert "different loss_fn" in losses and "label_smoothing': 0.1" in losses, losses
