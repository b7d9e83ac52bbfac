"""DeferredBatchNorm alone: running statistics after micro-batches equal one plain BatchNorm pass over
the whole mini-batch (the reference is torch's own nn.BatchNorm2d), on both of its paths (statistics
taken from the normalization itself in float32/float64; a separate float32 pass in other dtypes)."""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro.engine.batchnorm import DeferredBatchNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("sizes", [(3, 5, 8), (2, 2), (16,)])
def test_micro_batches_commit_one_full_batch_update(dtype: torch.dtype, sizes: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(sum(sizes), 6, 4, 3, dtype=torch.float64) * 3 + 7      # far from zero mean
    ref = nn.BatchNorm2d(6, momentum=0.3).double().train()
    expected = ref(x)
    ours = DeferredBatchNorm(6, momentum=0.3).to(dtype).train()
    outs = [ours(part.to(dtype)) for part in x.split(list(sizes))]
    assert int(ours.num_batches_tracked) == 0                                # nothing before commit
    ours.commit()
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(ours.running_mean.double(), ref.running_mean, **tol)
    torch.testing.assert_close(ours.running_var.double(), ref.running_var, **tol)
    assert int(ours.num_batches_tracked) == 1
    if len(sizes) == 1 and dtype != torch.bfloat16:                          # one micro-batch: same output
        torch.testing.assert_close(outs[0].double(), expected, **tol)


def test_discard_leaves_no_statistics() -> None:
    bn = DeferredBatchNorm(4).train()
    bn(torch.randn(5, 4))
    bn.discard()
    before = bn.running_mean.clone()
    bn.commit()
    torch.testing.assert_close(bn.running_mean, before)
    assert int(bn.num_batches_tracked) == 0


def test_pending_statistics_replaced_as_synchronized_batchnorm_does() -> None:
    torch.manual_seed(1)
    a, b = torch.randn(6, 3) + 2, torch.randn(10, 3) - 1
    bn = DeferredBatchNorm(3, momentum=1.0).train()
    bn(a)
    rows, mean, m2 = bn.pending_statistics()                                  # type: ignore[misc]
    assert rows == 6
    whole = torch.cat([a, b]).double()
    bn.replace_pending_statistics(16, whole.mean(0), ((whole - whole.mean(0)) ** 2).sum(0))
    bn.commit()
    torch.testing.assert_close(bn.running_var.double(), whole.var(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_mean.double(), whole.mean(0), rtol=1e-5, atol=1e-6)


def test_instance_norm_tracking_running_statistics_is_refused_where_the_pipeline_would_differ() -> None:
    from gpipe_repro import GPipe

    def layers() -> list[nn.Module]:
        return [nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True), nn.Flatten(),
                nn.LazyLinear(2)]
    for m, mode in [(2, "never"), (1, "always")]:
        with pytest.raises(ValueError, match=r"InstanceNorm2d\) with track_running_stats=True.*once per "
                                             "micro-batch and again on each recompute"):
            GPipe(layers(), partitions=2, balance=[2, 2], micro_batches=m, checkpoint=mode)
    GPipe(layers(), partitions=2, balance=[2, 2], micro_batches=1, checkpoint="except_last")
    GPipe([nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4), nn.Flatten(), nn.LazyLinear(2)], partitions=2,
          balance=[2, 2], micro_batches=4)                     # no running statistics: fine


def test_eval_with_batch_statistics_runs_the_batch_whole_as_plain_eval_does() -> None:
    """A BatchNorm without running statistics normalizes by its batch even in eval mode: per
    micro-batch the output would depend on M."""
    import copy
    import warnings

    from gpipe_repro import GPipe
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.ReLU(), nn.Linear(8, 3)]
    x = torch.randn(10, 6)
    plain = nn.Sequential(*copy.deepcopy(layers)).eval()(x)
    for m in (2, 4):
        pipe = GPipe(copy.deepcopy(layers), partitions=2, micro_batches=m).eval()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = pipe(x)
        torch.testing.assert_close(out, plain)
        assert any("normalizes by the batch in inference" in str(w.message) for w in caught)


def test_a_stage_commits_all_its_batchnorms_at_once_as_plain_batchnorms_would() -> None:
    """commit_many batches the layers' commits (features side by side): every layer's running
    statistics equal torch's own BatchNorm over the whole mini-batch, across layers of different
    widths and spatial sizes (different row counts), momentums, dtypes, unequal micro-batches, a
    cumulative momentum, a layer without running statistics and one that saw nothing."""
    from gpipe_repro.engine.batchnorm import commit_many

    torch.manual_seed(0)
    specs = [(3, 4, 0.1, torch.float32), (5, 2, 0.1, torch.float32), (7, 1, 0.1, torch.float32),
             (4, 3, 0.3, torch.float32), (6, 2, 0.1, torch.float64), (2, 2, None, torch.float32)]
    sizes = [5, 4, 4]
    ours, refs = [], []
    for c, hw, momentum, dtype in specs:
        x = torch.randn(sum(sizes), c, hw, hw, dtype=torch.float64) * 2 + 5
        bn = DeferredBatchNorm(c, momentum=momentum).to(dtype).train()
        ref = nn.BatchNorm2d(c, momentum=momentum).double().train()
        for step in range(2):                    # the second commit starts from committed statistics
            for part in (x + step).split(sizes):
                bn(part.to(dtype))
            ref(x + step)
            if step == 0:
                commit_many([bn])
        ours.append(bn)
        refs.append(ref)
    untracked = DeferredBatchNorm(3, track_running_stats=False).train()
    untracked(torch.randn(4, 3, 2, 2))
    idle = DeferredBatchNorm(3).train()
    commit_many([*ours, untracked, idle])
    for bn, ref in zip(ours, refs):
        torch.testing.assert_close(bn.running_mean.double(), ref.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn.running_var.double(), ref.running_var, rtol=1e-5, atol=1e-6)
        assert int(bn.num_batches_tracked) == 2 and bn.pending_statistics() is None
    assert untracked.pending_statistics() is None
    assert int(idle.num_batches_tracked) == 0 and torch.equal(idle.running_mean, torch.zeros(3))


def _sgd_pipe(layers: Any, **kw: Any) -> Any:
    from gpipe_repro import GPipe
    return GPipe(layers, loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                 **kw)


def test_silent_batchnorm_subclass_with_its_own_forward_is_refused() -> None:
    """A BatchNorm subclass with a forward of its own was replaced by DeferredBatchNorm, its forward
    dropped: loss and weights differed from plain training even at M=1."""
    class Scaled(nn.BatchNorm1d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2.0 + 1.0
    with pytest.raises(ValueError, match=r"layer 1 \(Scaled\) subclasses a BatchNorm with a forward of "
                                         "its own.*deferred_batchnorm=False"):
        _sgd_pipe([nn.Linear(4, 4), Scaled(4), nn.Linear(4, 3)], partitions=2, micro_batches=1)
    _sgd_pipe([nn.Linear(4, 4), Scaled(4), nn.Linear(4, 3)], partitions=2, micro_batches=1,
              deferred_batchnorm=False)

    class Plain(nn.BatchNorm1d):            # a subclass that keeps BatchNorm's forward converts
        pass
    _sgd_pipe([nn.Linear(4, 4), Plain(4), nn.Linear(4, 3)], partitions=2, micro_batches=2)


def test_silent_batchnorm_shared_by_two_layers_is_refused() -> None:
    """One BatchNorm module used by two layers: plain training updates its running statistics twice
    per forward, in order; two deferred copies over the same buffers each multiplied them by
    (1 - momentum) before either added its mean (running_mean off by 0.015 in one cell; across
    processes each would keep only its own update)."""
    class Block(nn.Module):
        def __init__(self, bn: nn.Module) -> None:
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 4), bn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.bn(self.lin(x)))
    bn = nn.BatchNorm1d(4)
    for balance in ([2, 1], [1, 2]):
        with pytest.raises(ValueError, match=r"layer 1 \(bn: BatchNorm1d\) is the same BatchNorm module "
                                             r"as layer 0 \(bn: BatchNorm1d\)"):
            _sgd_pipe([Block(bn), Block(bn), nn.Linear(4, 3)], partitions=2, balance=balance,
                      micro_batches=1)
    shared = nn.BatchNorm1d(4, track_running_stats=False)    # no statistics to update: fine
    _sgd_pipe([Block(shared), Block(shared), nn.Linear(4, 3)], partitions=2, micro_batches=2)


def test_silent_two_batchnorms_sharing_running_statistics_differed_from_plain_training() -> None:
    """Two BatchNorm modules over the same running_mean/running_var/num_batches_tracked tensors
    (passed the same-module check): running_mean 0.013 off plain training even at K=1, M=1 in one
    cell, num_batches_tracked halved across processes. Refused before any work, naming both."""
    for stat in ("running_mean", "running_var", "num_batches_tracked"):
        first, second = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
        setattr(second, stat, getattr(first, stat))
        layers = [nn.Linear(4, 4), first, nn.Linear(4, 4), second, nn.Linear(4, 3)]
        for partitions in (1, 2):
            with pytest.raises(ValueError, match=rf"layer 3 \(BatchNorm1d\) shares its {stat} with "
                                                 r"layer 1 \(BatchNorm1d\)"):
                _sgd_pipe(layers, partitions=partitions, micro_batches=1)
    own = [nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)]
    own[3].weight = own[1].weight                 # shared affine weights, statistics of its own: fine
    _sgd_pipe(own, partitions=2, micro_batches=2)


def test_silent_sync_batchnorm_updated_its_statistics_per_micro_batch_is_refused() -> None:
    """nn.SyncBatchNorm was neither converted nor refused: with the local runtime it updated its
    running statistics once per micro-batch and again per recompute."""
    with pytest.raises(ValueError, match=r"layer 1 \(SyncBatchNorm\) is an nn.SyncBatchNorm.*"
                                         "batchnorm_stats='synchronized'"):
        _sgd_pipe([nn.Linear(4, 4), nn.SyncBatchNorm(4), nn.Linear(4, 3)], partitions=2,
                  micro_batches=1, checkpoint="always")


def test_wrapping_a_model_leaves_it_a_plain_batchnorm_model() -> None:
    """GPipe replaced the BatchNorms nested in the user's own modules in place: a train-mode forward
    of the user's model afterwards never updated their running statistics and kept a pending entry
    per call. The pipeline now converts a shallow copy; the user's modules keep their BatchNorms,
    whose tensors the pipeline trains and commits into."""
    import copy

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.lin(x))
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.ReLU(), nn.Linear(4, 3))
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    pipe = _sgd_pipe(model, partitions=2, micro_batches=1)     # M=1: BatchNorm's batch is the whole
    assert type(model[0].bn) is nn.BatchNorm1d
    assert type(pipe.cells[0][0].bn) is DeferredBatchNorm
    pipe.train_step(x, y)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.CrossEntropyLoss()(reference(x), y).backward()
    optimizer.step()
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(mine, theirs, msg=name)
    before = model[0].bn.running_mean.clone()
    model.train()(x)                                   # the user's own forward: a plain BatchNorm
    assert not torch.equal(model[0].bn.running_mean, before)
    assert not pipe.cells[0][0].bn._pending


def test_one_row_micro_batches_under_batchnorm_name_the_layer_and_the_fix() -> None:
    """BatchNorm1d on (rows, features) cannot take batch statistics of one row; M equal to the batch
    raised PyTorch's own 'Expected more than 1 value per channel' from inside the pipeline. The
    error now names the layer, the cell and the micro-batch, and says to use fewer micro-batches."""
    from torch import nn

    from gpipe_repro import GPipe

    x, y = torch.randn(4, 3), torch.randn(4, 3)
    pipe = GPipe(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 3)), partitions=2,
                 micro_batches=4, loss_fn=nn.MSELoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                 balance=[1, 2])
    with pytest.raises(ValueError, match=r"layer 1 \(BatchNorm\) of cell 1 got micro-batch 0 of 1 "
                                         r"row.*fewer micro-batches"):
        pipe.train_step(x, y)
    assert pipe.step == 0


def _bn_model(track: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, track_running_stats=track), nn.ReLU(),
                         nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 3))


def test_silent_eval_model_eval_without_pipe_eval_normalized_each_micro_batch() -> None:
    """`model.eval()` on the caller's model (not `pipe.eval()`) reaches the layers, but pipe(x)
    read the pipeline's own flag: it ran M micro-batches, and a BatchNorm without running statistics
    normalized each (0.59 off plain eval), and a batch smaller than M was refused as in training.
    Reference: the same model, evaluated plainly."""
    import copy

    from gpipe_repro import GPipe

    model = _bn_model(track=False)
    reference = copy.deepcopy(model).eval()
    pipe = GPipe(model, partitions=2, micro_batches=4)
    model.eval()
    x = torch.randn(8, 6)
    with pytest.warns(UserWarning, match="has no running statistics"):
        torch.testing.assert_close(pipe(x), reference(x))
    torch.testing.assert_close(pipe(x[:2]), reference(x[:2]))


def test_silent_eval_a_batchnorm_left_training_was_split_and_its_statistics_never_taken() -> None:
    """`pipe.eval()`, then one BatchNorm put back in training mode (adapting at test time): plain
    eval normalizes by the whole batch and moves that BatchNorm's running statistics once; the
    pipeline normalized each micro-batch (0.59 off) and never moved them."""
    import copy

    from gpipe_repro import GPipe

    model = _bn_model(track=True)
    reference = copy.deepcopy(model).eval()
    reference[1].train()
    pipe = GPipe(model, partitions=2, micro_batches=4).eval()
    model[1].train()
    x = torch.randn(8, 6) * 3 + 1
    with pytest.warns(UserWarning, match="a BatchNorm is in training mode"):
        out = pipe(x)
    torch.testing.assert_close(out, reference(x))
    pipe.state_dict()          # the caller's modules up to date
    assert int(model[1].num_batches_tracked) == int(reference[1].num_batches_tracked) == 1
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var)


def test_inference_mode_infers_as_plain_eval() -> None:
    """pipe(x) under `torch.inference_mode()` failed on every configuration ("Inference tensors do
    not track version counter": the in-place guard reads them); it infers as plain eval does."""
    import copy

    from gpipe_repro import GPipe

    model = _bn_model(track=True)
    reference = copy.deepcopy(model).eval()
    x = torch.randn(7, 6)
    for k, m in ((1, 1), (2, 3)):
        pipe = GPipe(copy.deepcopy(model), partitions=k, micro_batches=m).eval()
        with torch.inference_mode():
            out = pipe(x)
        torch.testing.assert_close(out, reference(x))


def test_an_eval_call_leaves_the_next_training_forwards_masks_as_they_were() -> None:
    """A pipe(x) with every layer in eval mode draws no dropout mask, so it must not move the
    masks later training-mode calls draw (it took a call number all the same)."""
    import copy

    from gpipe_repro import GPipe

    model = _bn_model(track=True)
    x = torch.randn(8, 6)
    plain, interrupted = (GPipe(copy.deepcopy(model), partitions=2, micro_batches=2) for _ in range(2))
    expected = plain(x)
    interrupted.eval()
    interrupted(x)
    interrupted.train()
    torch.testing.assert_close(interrupted(x), expected)


def _modes_across_processes(runtime: str) -> dict[str, torch.Tensor]:
    """pipe(x) with a mode set on one layer of the second cell alone: a BatchNorm left training in
    an eval pipeline, then a Dropout left training among eval layers, then every layer training."""
    from gpipe_repro import GPipe

    torch.set_num_threads(1)
    model = _bn_model(track=True)
    pipe = GPipe(model, partitions=2, balance=[1, 5], micro_batches=3, checkpoint="never",
                 runtime=runtime)
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(1))
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.eval()
        model[1].train()
        out["adapting"] = pipe(x)
        pipe.train()
        model.eval()
        model[4].train()
        out["one dropout"] = pipe(x)
        model.train()
        out["training"] = pipe(x)
    return {k: v.clone() for k, v in out.items()}


def test_silent_eval_processes_read_only_their_own_cells_modes() -> None:
    """A distributed pipeline's processes read the modes of the cells they run: with a BatchNorm
    left training in the second cell alone, one process split the batch and the other did not (the
    job failed); with a Dropout training there alone, only its process counted the call, and the
    first process's masks moved from then on (2.27 off). They now take one answer for the job:
    each result equals the local runtime's, on both processes."""
    import copy

    from gpipe_repro.distributed.launcher import launch_local

    local = _modes_across_processes("local")
    reference = copy.deepcopy(_bn_model(track=True)).eval()
    reference[1].train()
    torch.testing.assert_close(local["adapting"],
                               reference(torch.randn(12, 6, generator=torch.Generator().manual_seed(1))))
    for ranks in launch_local(_modes_across_processes, 2, "distributed", job_timeout=120):
        for key, value in ranks.items():
            torch.testing.assert_close(value, local[key], msg=key)
