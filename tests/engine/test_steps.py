"""What a step commits, and when: all-or-nothing steps, global gradient clipping, mixed precision.

All three rest on the schedule's AGREE action (every stage's gradients final, the stages agree,
then they update).
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.engine.schedule import ActionKind
from gpipe_repro.engine.stage import StageExecutor
from tests.equivalence import assert_same_training, sgd_momentum


def model() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(inplace=True), nn.Dropout(0.2),
            nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)]


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(10, 6, generator=g), torch.randint(0, 3, (10,), generator=g)


def snapshot(pipe: GPipe) -> dict[str, Any]:
    return {"state": copy.deepcopy(pipe.state_dict()),
            "optimizers": [None if o is None else copy.deepcopy(o.state_dict()) for o in pipe.optimizers],
            "step": pipe.step}


def assert_unchanged(pipe: GPipe, before: dict[str, Any], where: str) -> None:
    assert pipe.step == before["step"], where
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, before["state"][name]), f"{where}: {name} changed"
    for o, saved in zip(pipe.optimizers, before["optimizers"]):
        if o is not None:
            now = o.state_dict()["state"]
            assert now.keys() == saved["state"].keys(), where
            for i in now:
                for key, value in now[i].items():
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(saved["state"][i][key])), \
                        f"{where}: optimizer state {key} changed"


def build(k: int = 3) -> GPipe:
    return GPipe(model(), partitions=k, micro_batches=2, balance=[3, 2, 2], checkpoint="except_last",
                 loss_fn=nn.CrossEntropyLoss(), optimizer=sgd_momentum)


def fail_at_last(executor: StageExecutor, kind: ActionKind, occurrences: int) -> None:
    """Make `executor`'s handler of `kind` raise at its last occurrence in the step."""
    real = executor.handlers[kind]
    calls = [0]

    def failing(m: int | None) -> None:
        calls[0] += 1
        if calls[0] == occurrences:
            raise RuntimeError(f"injected failure at {kind.value} on stage {executor.stage}")
        real(m)
    executor.handlers[kind] = failing


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_half_applied_steps_failure_at_each_action_kind_on_each_stage(stage: int) -> None:
    """A failure in any action (up to AGREE) of any stage changes nothing: parameters, optimizer
    state, BatchNorm statistics, step counter; and the next step equals one that never failed."""
    control = build()
    for seed in (1, 2):
        control.train_step(*batch(seed))
    kinds = [a.kind for a in control.make_schedule().stages[stage]]
    tried = 0
    for kind in sorted(set(kinds) - {ActionKind.OPTIMIZER_STEP}, key=lambda k: k.value):
        pipe = build()
        pipe.train_step(*batch(1))
        before = snapshot(pipe)
        real = pipe.executors[stage].handlers[kind]
        fail_at_last(pipe.executors[stage], kind, kinds.count(kind))
        with pytest.raises(RuntimeError, match="injected failure"):
            pipe.train_step(*batch(2))
        assert_unchanged(pipe, before, f"failure at {kind.value} on stage {stage}")
        pipe.executors[stage].handlers[kind] = real
        pipe.train_step(*batch(2))
        for name, value in control.state_dict().items():
            torch.testing.assert_close(pipe.state_dict()[name], value, rtol=0, atol=0,
                                       msg=lambda m, name=name, kind=kind: f"after a failed {kind.value}: "
                                                                           f"{name}: {m}")
        tried += 1
    assert tried >= 4


def test_half_applied_steps_stage0_last_backward_raises() -> None:
    """The finding's case: stage 0's last backward raises after the other stages finished theirs."""
    pipe = build()
    before = snapshot(pipe)
    fail_at_last(pipe.executors[0], ActionKind.BACKWARD, 2)
    with pytest.raises(RuntimeError, match="injected failure"):
        pipe.train_step(*batch(1))
    assert_unchanged(pipe, before, "stage 0's last backward")


def test_every_action_kind_has_a_handler() -> None:
    pipe = build()
    for e in pipe.executors:
        assert set(e.handlers) == set(ActionKind), set(ActionKind) - set(e.handlers)


def test_an_unknown_action_kind_is_refused_clearly() -> None:
    from gpipe_repro.engine.schedule import Action, ScheduleError
    pipe = build()
    del pipe.executors[1].handlers[ActionKind.AGREE]
    with pytest.raises(ScheduleError, match="stage 1 does not understand action.*agree"):
        pipe.executors[1].execute(Action(ActionKind.AGREE, 1))


# -- global gradient clipping ---------------------------------------------------------------------
@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_clip_grad_norm_is_global_and_equals_torch(max_norm: float) -> None:
    batches = [batch(s) for s in range(3)]
    pipe = assert_same_training(model(), None, None, nn.CrossEntropyLoss(), partitions=3, micro_batches=3,
                                checkpoint="always", batches=batches, optimizer=sgd_momentum,
                                clip_grad_norm=max_norm,
                                atol=1e-5)
    assert pipe.last_grad_norm is not None
    clipped = pipe.last_grad_norm > max_norm
    assert clipped == (max_norm < 1), f"norm {pipe.last_grad_norm} vs max {max_norm}"


def test_clip_grad_norm_reports_the_norm_torch_reports() -> None:
    x, y = batch(0)
    pipe = GPipe(model(), partitions=3, micro_batches=2, loss_fn=nn.CrossEntropyLoss(), clip_grad_norm=1e9,
                 optimizer=None)
    pipe.train_step(x, y)
    grads = [p.grad for p in pipe.unpartitioned().parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert pipe.last_grad_norm == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("where", ["nan", "inf"])
def test_silent_clipping_a_nonfinite_gradient_left_the_other_weights_as_they_were(where: str) -> None:
    """One NaN in one weight's gradient, `clip_grad_norm=1.0`: `clip_grad_norm_` on the plain model
    returns a NaN norm and multiplies every gradient by NaN, so every weight it updates is NaN; the
    pipeline turned the norm into inf, clipped by 0, and left every weight but that one unchanged
    (9 of 484 weights NaN), reporting inf. It now keeps torch's NaN (and its inf: coefficient 0,
    the infinite gradient NaN) for the norm and the update, at any K."""
    def poisoned() -> list[nn.Module]:
        torch.manual_seed(0)
        layers = [nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3)]
        layers[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float(where)))
        return layers
    x, y = torch.randn(8, 20), torch.randint(0, 3, (8,))
    plain = nn.Sequential(*poisoned())
    nn.CrossEntropyLoss()(plain(x), y).backward()
    norm = nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    pipe = GPipe(nn.Sequential(*poisoned()), partitions=2, micro_batches=1, loss_fn=nn.CrossEntropyLoss(),
                 clip_grad_norm=1.0, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    pipe.train_step(x, y)
    got = dict(pipe.unpartitioned().named_parameters())
    assert str(pipe.last_grad_norm) == str(float(norm))
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p, equal_nan=True, msg=lambda m, name=name: f"{name}: {m}")


def test_bad_clip_grad_norm() -> None:
    with pytest.raises(ValueError, match="clip_grad_norm must be a number > 0"):
        GPipe(model(), clip_grad_norm=0)


# -- mixed precision ------------------------------------------------------------------------------
def cut_before_linears() -> tuple[list[nn.Module], list[int]]:
    """Cells that begin with a Linear: autocast casts their input to the low dtype anyway, so the
    low-precision boundary changes nothing and the pipeline equals plain autocast exactly."""
    torch.manual_seed(0)
    return ([nn.Linear(6, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)],
            [3, 2, 1])


def test_bf16_equals_plain_autocast() -> None:
    layers, balance = cut_before_linears()
    batches = [batch(s) for s in range(3)]
    pipe = assert_same_training(layers, None, None, nn.CrossEntropyLoss(), partitions=3, micro_batches=2,
                                checkpoint="except_last", balance=balance, batches=batches,
                                optimizer=sgd_momentum, precision="bf16", rtol=1e-4, atol=1e-4)
    assert all(p.dtype == torch.float32 for p in pipe.parameters()), "master weights stay fp32"


class Residual(nn.Module):
    """x + Linear(LayerNorm(x)): under autocast an fp32 stream plus a low-precision update stays fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.norm(x))


@pytest.mark.parametrize("low, expected", [(False, [torch.float32, torch.bfloat16]),
                                           (True, [torch.bfloat16, torch.bfloat16])])
def test_bf16_boundary_activations_cross_as_computed_or_in_bf16_where_asked(
        low: bool, expected: list[torch.dtype]) -> None:
    """The first cell ends with a residual add (fp32 under autocast), the second with a Linear
    (bf16): each crosses in its own dtype unless `low_precision_boundaries` casts both to bf16."""
    torch.manual_seed(0)
    layers = [nn.ConstantPad1d((0, 10), 0.0), Residual(), Residual(), nn.Linear(16, 16), nn.Linear(16, 3)]
    pipe = GPipe(layers, partitions=3, micro_batches=1, balance=[2, 2, 1], loss_fn=nn.CrossEntropyLoss(),
                 precision="bf16", optimizer=None, low_precision_boundaries=low)
    sent: list[torch.dtype] = []
    real = pipe.runtime.transport.send_activation
    pipe.runtime.transport.send_activation = lambda s, m, v: (sent.append(v.dtype), real(s, m, v))[1]  # type: ignore
    pipe.train_step(*batch(0))
    assert sent == expected


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_silent_low_precision_boundaries_rounded_a_residual_stream_plain_autocast_keeps_in_fp32(
        precision: str) -> None:
    """Cells that begin with a norm (every Hugging Face decoder block does) over a residual stream
    autocast keeps in fp32 (it starts from an op autocast leaves in fp32: here a pad, in a decoder
    the embedding): the pipeline cast the stream to bf16/fp16 at each cell boundary, so the
    next cell's norm saw a rounded input and training differed from plain autocast by about as much
    as bf16 differs from fp32. Boundary values now cross as computed: equal to plain autocast (the
    tolerance of the reduction order, not of the low dtype)."""
    torch.manual_seed(0)
    layers = [nn.ConstantPad1d((0, 10), 0.0), Residual(), Residual(), Residual(), nn.Linear(16, 3)]
    batches = [batch(s) for s in range(3)]
    pipe = assert_same_training(layers, None, None, nn.CrossEntropyLoss(), partitions=3, micro_batches=2,
                                checkpoint="except_last", balance=[2, 1, 2], batches=batches,
                                optimizer=sgd_momentum, precision=precision, rtol=1e-5, atol=1e-5)
    assert not pipe.low_precision_boundaries


def plain_fp16_scaler_training(layers: list[nn.Module], batches: list[Any], inject: set[int]) -> list[float]:
    """Plain PyTorch: autocast fp16 + torch.amp.GradScaler, with the same inf injection."""
    model_ = nn.Sequential(*layers)
    opt = sgd_momentum(model_.parameters())
    scaler = torch.amp.GradScaler("cpu")
    state = {"step": 0}
    layers[0].weight.register_hook(lambda g: g * float("inf") if state["step"] in inject else g)
    scales = []
    for step, (x, y) in enumerate(batches):
        state["step"] = step
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model_(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_fp16_overflow_in_one_cell_skips_every_cell_and_halves_the_scale() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]
    plain = copy.deepcopy(layers)
    batches = [batch(s) for s in range(4)]
    pipe = GPipe(layers, partitions=3, micro_batches=1, balance=[2, 2, 1], loss_fn=nn.CrossEntropyLoss(),
                 precision="fp16", optimizer=sgd_momentum, checkpoint="never")
    inject = {1}
    state = {"step": 0}
    pipe.cells[0][0].weight.register_hook(lambda g: g * float("inf") if state["step"] in inject else g)
    scales = []
    for step, (x, y) in enumerate(batches):
        state["step"] = step
        before = snapshot(pipe)
        pipe.train_step(x, y)
        if step in inject:
            assert pipe.last_step_skipped
            before["step"] += 1          # the step counter advances; nothing else may change
            assert_unchanged(pipe, before, "overflow in cell 0")
        else:
            assert not pipe.last_step_skipped
        scales.append(pipe.loss_scale)
    expected_scales = plain_fp16_scaler_training(plain, batches, inject)
    assert scales == expected_scales == [65536.0, 32768.0, 32768.0, 32768.0]
    for p, q in zip(pipe.unpartitioned().parameters(), nn.Sequential(*plain).parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


def test_silent_scale_an_fp32_state_loaded_into_fp16_set_the_loss_scale_to_1() -> None:
    """`fp16.load_training_state(fp32.training_state())` set the fp16 pipeline's loss scale from
    65536 (GradScaler's start) to the fp32 pipeline's 1.0, without a word: its small gradients then
    underflow in fp16, and the scale grows back only after 2000 clean steps. A pipeline without fp16
    has no loss scale to resume: it saves none, and a pipeline without fp16 keeps its scale of 1
    when given an fp16 state; fp16 to fp16 still resumes the scale and its growth tracker."""
    def pipe(precision: str) -> GPipe:
        return GPipe(model(), partitions=2, micro_batches=2, loss_fn=nn.CrossEntropyLoss(),
                     precision=precision, optimizer=sgd_momentum)
    fp32, fp16 = pipe("fp32"), pipe("fp16")
    fp32.train_step(*batch(0))
    fp16.load_training_state(fp32.training_state())
    assert fp16.loss_scale == 65536.0
    fp16.loss_scaler.scale, fp16.loss_scaler.growth_tracker = 512.0, 7
    again = pipe("fp16")
    again.load_training_state(fp16.training_state())
    assert (again.loss_scale, again.loss_scaler.growth_tracker) == (512.0, 7)
    fp32.load_training_state(fp16.training_state())
    assert fp32.loss_scale == 1.0


def test_silent_resume_a_state_of_another_m_loaded_without_a_word() -> None:
    """A state saved at M=2 loaded into a pipeline at M=4 without a word: the steps that follow
    draw other dropout masks and BatchNorm micro-batches than the saved run's (the command line
    refuses a changed --m on resume; the Python API said nothing). It loads, with a warning that
    says how to continue the run exactly; the same M loads silently."""
    def pipe(m: int) -> GPipe:
        return GPipe(model(), partitions=2, micro_batches=m, loss_fn=nn.CrossEntropyLoss(),
                     optimizer=sgd_momentum)
    saved = pipe(2)
    saved.train_step(*batch(0))
    with pytest.warns(UserWarning, match=r"micro_batches=2, this pipeline runs 4.*micro_batches=2 to "
                                         "continue it exactly"):
        pipe(4).load_training_state(saved.training_state())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(2).load_training_state(saved.training_state())


def test_bad_precision() -> None:
    with pytest.raises(ValueError, match="precision must be one of"):
        GPipe(model(), precision="fp8")
