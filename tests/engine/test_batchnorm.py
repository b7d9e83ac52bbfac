"""DeferredBatchNorm alone: running statistics after micro-batches equal one plain BatchNorm pass over
the whole mini-batch (the reference is torch's own nn.BatchNorm2d), on both of its paths (statistics
taken from the normalization itself in float32/float64; a separate float32 pass in other dtypes)."""
from __future__ import annotations

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
        with pytest.raises(ValueError, match="InstanceNorm2d with track_running_stats=True.*once per "
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
        assert any("normalizes by the batch in eval mode" in str(w.message) for w in caught)


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
