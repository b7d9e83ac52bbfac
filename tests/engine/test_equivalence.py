"""GPipe training equals plain training, per parameter, across K, M, checkpoint modes and models.

The reference (tests/equivalence.py) imports no engine code: its own micro-batches, its own dropout
seeds from the documented rule, its own BatchNorm statistics rule. Every comparison runs 3 steps on
3 different batches, alternating SGD with momentum and Adam, so the step number, the optimizer state
and the zeroing of gradients between steps all matter.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpipe_repro import GPipe
from tests.equivalence import adam, assert_same_training, reference_step, sgd_momentum

KS = [1, 2, 3, 4]
MS = [1, 3, 7]   # 11 examples: M=3 and M=7 are uneven
MODES = ["always", "except_last", "never"]


def mlp() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 16), nn.GELU(),
            nn.Dropout(0.1), nn.Linear(16, 3)]


def convnet() -> list[nn.Module]:
    torch.manual_seed(1)
    return [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout2d(0.2),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()), nn.Linear(8, 5)]


class Embed(nn.Module):
    """ids -> (hidden, ids, pad mask): integer and bool tensors ride along without gradients."""

    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(16, d) * 0.02)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tok(ids) + self.pos[: ids.shape[1]], ids, ids != 0


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x: tuple) -> tuple:
        h, ids, keep = x
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :] & torch.ones(t, t, dtype=torch.bool).tril()
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.ff(self.ln2(h)), ids, keep


class Head(nn.Module):
    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x: tuple) -> torch.Tensor:
        return self.out(self.ln(x[0]))


def transformer() -> list[nn.Module]:
    torch.manual_seed(2)
    return [Embed(20, 16), Block(16, 2), Block(16, 2), Block(16, 2), Head(16, 20)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def data(kind: str, n: int = 11, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    if kind == "conv":
        return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 5, (n,), generator=g)
    ids = torch.randint(1, 20, (n, 7), generator=g)
    ids[:, -2:] = 0  # padding: the bool mask crosses every boundary
    return ids, torch.randint(0, 20, (n, 7), generator=g)


MODELS = {"mlp": (mlp, nn.CrossEntropyLoss()), "conv": (convnet, nn.CrossEntropyLoss()),
          "transformer": (transformer, lm_loss)}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", KS)
def test_equal_to_plain_training(kind: str, mode: str, k: int) -> None:
    build, loss_fn = MODELS[kind]
    batches = [data(kind, seed=3 + step) for step in range(3)]
    for i, m in enumerate(MS):
        assert_same_training(build(), None, None, loss_fn, partitions=k, micro_batches=m, checkpoint=mode,
                             batches=batches, optimizer=(sgd_momentum, adam)[(i + k) % 2], atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sum_and_mean_losses_accumulate_to_the_full_batch_gradient(reduction: str) -> None:
    x, y = data("mlp", n=10)
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)]  # no dropout: M=1 reference = full batch
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    full = copy.deepcopy(layers)
    loss_full = loss_fn(nn.Sequential(*full)(x), y)
    loss_full.backward()
    pipe = assert_same_training(layers, x, y, loss_fn, partitions=2, micro_batches=4,
                                checkpoint="except_last", loss_reduction=reduction)
    assert pipe.step == 1
    ours = [p for p in pipe.unpartitioned().parameters()]
    for p, q in zip(ours, nn.Sequential(*full).parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_deferred_batchnorm_running_stats_equal_one_full_batch_pass() -> None:
    """Each DeferredBatchNorm's running stats equal a plain BatchNorm's after ONE update from all of
    that layer's inputs in the mini-batch (the first BN: exactly a plain full-batch forward)."""
    x, y = data("conv", n=13)
    layers = convnet()
    plain = nn.Sequential(*copy.deepcopy(layers)).train()
    with torch.no_grad():
        plain(x)
    # What each BN really sees under micro-batching: capture its inputs in the reference loop.
    ref = copy.deepcopy(layers)
    seen: dict[int, list[torch.Tensor]] = {i: [] for i, mod in enumerate(ref)
                                           if isinstance(mod, nn.BatchNorm2d)}
    for i in seen:
        ref[i].register_forward_hook(lambda mod, inp, out, i=i: seen[i].append(inp[0].detach()))
    reference_step(ref, x, y, nn.CrossEntropyLoss(), micro_batches=4)
    pipe = GPipe(copy.deepcopy(layers), partitions=3, micro_batches=4, checkpoint="always",
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    pipe.train_step(x, y)
    ours = pipe.unpartitioned()
    first = min(seen)
    for i, inputs in seen.items():
        expected = copy.deepcopy(layers[i]).train()
        with torch.no_grad():
            expected(torch.cat(inputs))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(ours[i], name).float(), getattr(expected, name).float(),
                                       rtol=1e-5, atol=1e-6,
                                       msg=lambda m, i=i, name=name: f"BN {i} {name}: {m}")
        if i == first:
            for name in ("running_mean", "running_var"):
                torch.testing.assert_close(getattr(ours[i], name), getattr(plain[i], name),
                                           rtol=1e-5, atol=1e-6)


def test_dropout_masks_do_not_depend_on_partitioning() -> None:
    x, y = data("transformer")
    losses = []
    for k in (1, 2, 5):
        pipe = GPipe(transformer(), partitions=k, micro_batches=3, checkpoint="always", loss_fn=lm_loss,
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        losses.append([pipe.train_step(x, y) for _ in range(3)])
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(losses[2]), torch.tensor(losses[0]), rtol=1e-5, atol=1e-6)


def test_caller_rng_stream_is_untouched_by_a_step() -> None:
    x, y = data("mlp")
    pipe = GPipe(mlp(), partitions=2, micro_batches=3, loss_fn=nn.CrossEntropyLoss(),
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    pipe.train_step(x, y)
    torch.testing.assert_close(torch.rand(3), expected)


def test_a_stored_reference_is_reused_only_for_the_same_run_and_still_catches_a_wrong_pipeline() -> None:
    """tests/equivalence.py runs each distinct reference once per process: what it keys on
    distinguishes a changed weight, a module attribute no weight shows (Block.heads), a layer listed
    twice instead of two equal copies, another M; and a pipeline compared against a stored reference
    still fails when it trains differently."""
    import tests.equivalence as eq

    x, y = data("mlp")
    batches = [(x, y)]
    loss_fn = nn.CrossEntropyLoss()

    def same(a: list[nn.Module], b: list[nn.Module], m: int = 3, n: int = 3) -> bool:
        return (eq._reference_key(a, batches, loss_fn, m, sgd_momentum) ==
                eq._reference_key(b, batches, loss_fn, n, sgd_momentum))

    assert same(mlp(), mlp())
    changed = mlp()
    with torch.no_grad():
        changed[0].weight[0, 0] += 1e-3
    assert not same(mlp(), changed)
    assert not same(mlp(), mlp(), m=3, n=7)
    assert not same([Block(16, 2)], [Block(16, 4)])
    lin = nn.Linear(6, 6)
    assert not same([lin, lin], [lin, copy.deepcopy(lin)])

    assert_same_training(mlp(), None, None, loss_fn, partitions=2, micro_batches=3, checkpoint="never",
                         batches=batches, optimizer=sgd_momentum)
    stored = len(eq._REFERENCES)
    with pytest.raises(AssertionError, match="differ"):      # the same reference, other dropout masks
        assert_same_training(mlp(), None, None, loss_fn, partitions=2, micro_batches=3, checkpoint="never",
                             batches=batches, optimizer=sgd_momentum, seed=1)
    assert_same_training(mlp(), None, None, loss_fn, partitions=3, micro_batches=3, checkpoint="always",
                         batches=batches, optimizer=sgd_momentum)
    assert len(eq._REFERENCES) == stored                    # both compared against the stored run
