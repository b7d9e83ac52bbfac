"""A parameter tied across cells (an embedding and the output head sharing one matrix) trains like the
plain tied model, per parameter, for every schedule, checkpoint mode and precision.

Each comparison runs 3 steps on 3 batches against :func:`tests.equivalence.reference_train`, plain
PyTorch on the original tied model (it imports no engine code): every loss, then every parameter
and gradient under every name it has (the tied matrix is compared in each cell holding a copy), and
the copies must be bit-identical (:func:`tests.equivalence.assert_copies_identical`).
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe
from tests.engine.test_equivalence import lm_loss
from tests.equivalence import adam, assert_copies_identical, assert_same_training, sgd_momentum, tied_copies

VOCAB, D = 24, 12


def tied_model(seed: int = 0, dropout: float = 0.1) -> list[nn.Module]:
    """Embedding -> Linear/GELU blocks (with dropout) -> a head whose weight IS the embedding's."""
    torch.manual_seed(seed)
    embedding, head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB, bias=False)
    head.weight = embedding.weight
    return [embedding, nn.Linear(D, D), nn.GELU(), nn.Dropout(dropout), nn.Linear(D, D), nn.GELU(), head]


def batches(n: int = 11, steps: int = 3, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (n, 5), generator=g), torch.randint(0, VOCAB, (n, 5), generator=g))
            for _ in range(steps)]


# (schedule, partitions, micro-batches, checkpoint, optimizer, extra GPipe arguments)
CONFIGS: list[tuple[str, int, int, str, Any, dict[str, Any]]] = [
    ("gpipe", 2, 3, "always", adam, {}),
    ("gpipe", 3, 3, "except_last", sgd_momentum, {"clip_grad_norm": 0.05}),
    ("gpipe", 4, 7, "never", adam, {}),
    ("1f1b", 3, 3, "except_last", sgd_momentum, {}),
    ("1f1b", 2, 4, "always", adam, {"clip_grad_norm": 0.05}),
    ("zb-h1", 2, 3, "never", adam, {}),
    ("zb-h1", 3, 4, "always", sgd_momentum, {"clip_grad_norm": 0.05}),
    ("interleaved", 4, 2, "except_last", adam, {}),        # 2 cells per process, 2 processes
    ("zb-v", 4, 2, "never", sgd_momentum, {"clip_grad_norm": 0.05}),   # cells 0 and 3 on one process
]


@pytest.mark.parametrize("schedule,k,m,checkpoint,optimizer,extra", CONFIGS,
                         ids=[f"{c[0]}-K{c[1]}-M{c[2]}-{c[3]}{'-clip' if c[5] else ''}" for c in CONFIGS])
def test_tied_embedding_and_head_train_like_the_plain_tied_model(
        schedule: str, k: int, m: int, checkpoint: str, optimizer: Any, extra: dict[str, Any]) -> None:
    data = batches()
    pipe = assert_same_training(tied_model(), *data[0], lm_loss, partitions=k, micro_batches=m,
                                checkpoint=checkpoint, batches=data, optimizer=optimizer,
                                schedule=schedule, cost="params", **extra)
    assert [t.cells for t in pipe.ties] == [[0, k - 1]], "the embedding and the head are in different cells"
    if "clip_grad_norm" in extra:
        assert pipe.last_grad_norm is not None and pipe.last_grad_norm > extra["clip_grad_norm"], \
            "clipping was not exercised"


@pytest.mark.parametrize("precision,rtol", [("bf16", 1e-4), ("fp16", 1e-4)])
def test_tied_parameters_under_low_precision(precision: str, rtol: float) -> None:
    data = batches()
    pipe = assert_same_training(tied_model(), *data[0], lm_loss, partitions=3, micro_batches=3,
                                checkpoint="except_last", batches=data, optimizer=sgd_momentum,
                                precision=precision, rtol=rtol, atol=rtol, cost="params")
    assert len(pipe.ties) == 1 and not pipe.last_step_skipped


def test_a_tie_inside_one_cell_stays_one_parameter() -> None:
    data = batches()
    pipe = assert_same_training(tied_model(), *data[0], lm_loss, partitions=2, micro_batches=3,
                                checkpoint="never", batches=data, optimizer=adam, balance=[1, 6])
    pipe_one = assert_same_training(tied_model(), *data[0], lm_loss, partitions=1, micro_batches=3,
                                    checkpoint="never", batches=data, optimizer=adam)
    assert [t.cells for t in pipe.ties] == [[0, 1]] and pipe_one.ties == []
    head, embedding = pipe_one.cells[0][6], pipe_one.cells[0][0]
    assert head.weight is embedding.weight


def test_global_grad_norm_counts_a_tied_parameter_once() -> None:
    """As clip_grad_norm_ on the plain model: the tied matrix's gradient (the sum of its uses) once."""
    x, y = batches(steps=1)[0]
    plain = nn.Sequential(*tied_model(dropout=0.0))
    lm_loss(plain(x), y).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9))
    for k in (2, 4):
        pipe = GPipe(tied_model(dropout=0.0), partitions=k, micro_batches=2, loss_fn=lm_loss, optimizer=None,
                     clip_grad_norm=1e9, cost="params")
        pipe.train_step(x, y)
        assert pipe.last_grad_norm == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_gpt2_with_tied_embeddings_trains_like_the_plain_model(k: int) -> None:
    """GPT-2's default ties wte and lm_head. SGD: Adam turns the attention key bias's gradient (zero
    but for rounding: softmax ignores it) into full-size steps of rounding noise."""
    from gpipe_repro.models.hf_gpt2 import gpt2_config, gpt2_layers
    torch.manual_seed(0)
    config = gpt2_config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, dropout=0.0)
    layers = list(gpt2_layers(config))
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 64, (6, 9), generator=g) for _ in range(2)]
    data = [(i[:, :-1], i[:, 1:]) for i in ids]
    pipe = assert_same_training(layers, *data[0], lm_loss, partitions=k, micro_batches=3,
                                checkpoint="except_last", batches=data, optimizer=sgd_momentum,
                                rtol=1e-5, atol=1e-5, cost="params")
    assert [t.cells for t in pipe.ties] == [[0, k - 1]]


def _trained_pipe(**kwargs: Any) -> GPipe:
    pipe = GPipe(tied_model(), partitions=3, micro_batches=3, loss_fn=lm_loss, optimizer=adam,
                 cost="params", **kwargs)
    pipe.train_step(*batches(steps=1)[0])
    return pipe


def test_state_dict_gives_the_tied_value_under_each_name() -> None:
    pipe = _trained_pipe()
    state = pipe.state_dict()
    (first, first_name), (last, last_name) = pipe.ties[0].holders
    a, b = state[f"cells.{first}.{first_name}"], state[f"cells.{last}.{last_name}"]
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_load_state_dict_refuses_copies_that_differ_and_changes_nothing() -> None:
    pipe = _trained_pipe()
    state = copy.deepcopy(pipe.state_dict())
    (first, first_name), (last, last_name) = pipe.ties[0].holders
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    state[f"cells.{last}.{last_name}"] += 1.0
    with pytest.raises(ValueError, match="different values under"):
        pipe.load_state_dict(state)
    del state[f"cells.{last}.{last_name}"]
    with pytest.raises(ValueError, match="but not its copies"):
        pipe.load_state_dict(state, strict=False)
    assert all(torch.equal(v, pipe.state_dict()[k]) for k, v in before.items()), "nothing was loaded"


def test_load_training_state_keeps_the_copies_identical_and_resumes_exactly() -> None:
    data = batches(steps=3)
    pipe = _trained_pipe(clip_grad_norm=0.05)
    resumed = GPipe(tied_model(seed=1), partitions=3, micro_batches=3, loss_fn=lm_loss, optimizer=adam,
                    clip_grad_norm=0.05, cost="params")
    resumed.load_training_state(copy.deepcopy(pipe.training_state()))
    assert_copies_identical(resumed)
    for x, y in data[1:]:
        assert pipe.train_step(x, y) == resumed.train_step(x, y)
    assert_copies_identical(resumed)
    for a, b in zip(pipe.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_the_copies_stay_bit_identical_after_many_steps() -> None:
    pipe = GPipe(tied_model(), partitions=4, micro_batches=3, loss_fn=lm_loss, cost="params",
                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
                 clip_grad_norm=0.5, schedule="zb-h1")
    for x, y in batches(steps=12, seed=7):
        pipe.train_step(x, y)
    assert_copies_identical(pipe)
    copies = tied_copies(pipe)[0]
    assert len(copies) == 2 and copies[0].device == copies[1].device


def test_pipelining_untied_the_callers_model() -> None:
    """Each later cell holding a tied weight gets its own copy; the copy was set into the caller's
    own module, so after GPipe(...) the caller's head no longer was its embedding (a plain step on
    that model then trained two weights apart, and it had one parameter more). The cells now hold
    shallow copies of the modules along the way; the caller's model keeps its tie, and the weight
    it holds is the one the pipeline trains."""
    layers = tied_model(dropout=0.0)
    embedding, head = layers[0], layers[-1]
    count = len(list(nn.Sequential(*layers).parameters()))
    pipe = GPipe(layers, partitions=2, micro_batches=2, loss_fn=lm_loss, balance=[3, 4],
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert head.weight is embedding.weight
    assert len(list(nn.Sequential(*layers).parameters())) == count
    before = embedding.weight.detach().clone()
    x, y = batches()[0]
    pipe.train_step(x, y)
    assert head.weight is embedding.weight and not torch.equal(embedding.weight, before)
    assert torch.equal(pipe.cells[1][-1].weight, embedding.weight)      # the last cell's copy
    assert pipe.cells[1][-1] is not head


@pytest.mark.parametrize("kind", ["tensor", "post-accumulate"])
def test_silent_tied_hook_saw_one_cells_share_of_a_tied_weights_gradient(kind: str) -> None:
    """A gradient hook on a weight tied across cells (GPT-2's wte scaled by 0.5) ran on one cell's
    copy, on that cell's share only, under every schedule; plain training's runs on the sum of the
    embedding's and the head's shares. Now refused before any work."""
    layers = tied_model(dropout=0.0)
    weight = layers[0].weight
    if kind == "tensor":
        weight.register_hook(lambda g: g * 0.5)
    else:
        weight.register_post_accumulate_grad_hook(lambda p: None)
    pipe = GPipe(layers, partitions=2, balance=[3, 4], micro_batches=2, checkpoint="never",
                 loss_fn=lm_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    before = copy.deepcopy(pipe.state_dict())
    with pytest.raises(ValueError, match="gradient hook.*tied across cells 0, 1.*one cell's share"):
        pipe.train_step(*batches()[0])
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, before[name]), name



class _Pool(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mean(1)


class _Clamped(nn.Linear):
    """Keeps its weight in [-0.2, 0.2], in place, in its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.clamp_(-0.2, 0.2)
        return super().forward(x)


def test_silent_a_max_norm_embedding_tied_to_the_head_trained_off_plain_pytorch() -> None:
    """nn.Embedding(max_norm=...) renormalizes its weight in place in every forward; tied to the head
    in another cell, only the embedding's copy changed, the head's went on without it (loss 3.158
    against plain PyTorch's 2.989 from the first step, the copies apart for good). Refused when the
    pipeline is built, before any work; in one cell it trains as plain PyTorch."""
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        embedding = nn.Embedding(20, 8, max_norm=1.0)
        head = nn.Linear(8, 20, bias=False)
        head.weight = embedding.weight
        return nn.Sequential(embedding, _Pool(), nn.Linear(8, 8), nn.Tanh(), head)

    with pytest.raises(ValueError, match="max_norm=1.0, which renormalizes its weight in place"):
        GPipe(model(), partitions=2, balance=[2, 3], micro_batches=1, loss_fn=nn.CrossEntropyLoss())
    x, y = torch.randint(0, 20, (12, 5)), torch.randint(0, 20, (12,))
    pipe = GPipe(model(), partitions=1, micro_batches=1, checkpoint="never",
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert pipe.train_step(x, y) == pytest.approx(float(nn.CrossEntropyLoss()(model()(x), y)), rel=1e-6)


def test_silent_a_weight_clamped_in_its_forward_left_its_tied_copy_behind() -> None:
    """A layer clamping its own weight in its forward, that weight tied to a plain layer in another
    cell: the clamp changed its cell's copy only (loss 1.38610 against plain PyTorch's 1.38724). The
    step is refused at its AGREE, before any update; the same module at two places clamps each copy
    alike and trains as plain PyTorch does."""
    def tied() -> nn.Sequential:
        torch.manual_seed(0)
        clamped, plain = _Clamped(8, 8), nn.Linear(8, 8)
        plain.weight = clamped.weight
        return nn.Sequential(nn.Linear(4, 8), clamped, nn.Tanh(), plain, nn.Linear(8, 3))

    def shared() -> nn.Sequential:
        torch.manual_seed(0)
        clamped = _Clamped(8, 8)
        return nn.Sequential(nn.Linear(4, 8), clamped, nn.Tanh(), clamped, nn.Linear(8, 3))

    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    layers = tied()
    pipe = GPipe(layers, partitions=2, balance=[2, 3], micro_batches=1, checkpoint="never",
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    others = [p.detach().clone() for n, p in layers.named_parameters() if not n.startswith("1.")]
    with pytest.raises(ValueError, match="changed in place during the step"):
        pipe.train_step(x, y)
    assert all(torch.equal(a, p) for a, p in
               zip(others, [p for n, p in layers.named_parameters() if not n.startswith("1.")]))
    pipe = GPipe(shared(), partitions=2, balance=[2, 3], micro_batches=1, checkpoint="never",
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert pipe.train_step(x, y) == pytest.approx(float(nn.CrossEntropyLoss()(shared()(x), y)), rel=1e-6)


def test_silent_drift_a_later_cells_copy_changed_between_steps_trained_apart() -> None:
    """Between two steps, `pipe.cells[-1]`'s copy of the tied head weight changed in place (under
    no_grad; or `.data = ...`): the local runtime trained on with the copies 1.0 apart, 1.0 off
    plain PyTorch's one parameter, and the next change of the weight itself overwrote it. A later
    cell's copy changed since the pipeline last set it is now refused before the step, naming the
    weight, in training and in inference; the weight itself (the caller's) changed is still followed
    into every copy, and a copy changed alike with it passes."""
    def build() -> tuple[GPipe, list[nn.Module]]:
        layers = tied_model(dropout=0.0)
        return GPipe(layers, partitions=2, micro_batches=2, balance=[4, 3], loss_fn=lm_loss,
                     optimizer=sgd_momentum), layers
    x, y = batches(steps=1)[0]
    pipe, layers = build()
    pipe.train_step(x, y)
    copy_ = pipe.cells[1][-1].weight
    assert copy_ is not layers[0].weight
    with torch.no_grad():
        copy_.add_(1.0)
    with pytest.raises(ValueError, match="copy of 'layer 6.weight', a weight tied across cells, was "
                                         "changed in place"):
        pipe.train_step(x, y)
    with pytest.raises(ValueError, match="was changed in place"):
        pipe.eval()(x)
    pipe, layers = build()
    pipe.train_step(x, y)
    copy_ = pipe.cells[1][-1].weight
    copy_.data = copy_.data + 1.0
    with pytest.raises(ValueError, match="was changed in place"):
        pipe.train_step(x, y)
    pipe, layers = build()                   # the weight itself, and both alike: followed
    pipe.train_step(x, y)
    with torch.no_grad():
        layers[0].weight.mul_(0.5)
    pipe.train_step(x, y)
    with torch.no_grad():
        layers[0].weight.add_(1.0)
        pipe.cells[1][-1].weight.add_(1.0)
    pipe.train_step(x, y)
    assert_copies_identical(pipe)
