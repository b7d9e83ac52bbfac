"""The zero-bubble schedule ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the
backward split into input-gradient (I) and weight-gradient (W) actions, its validator rules, and
training equal per parameter to plain training (the independent reference, tests/equivalence.py)
in every checkpoint mode."""
from __future__ import annotations

import copy
import textwrap
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.engine.interpreter import run_dataflow
from gpipe_repro.engine.schedule import ActionKind, Schedule, ScheduleError, make_schedule
from tests.engine.test_equivalence import MODELS, data
from tests.equivalence import adam, assert_same_training, sgd_momentum


def unit_span(schedule: Schedule, backward: float = 2.0) -> float:
    """Makespan with T_F = T_I = T_W = 1 (B = I + W), instant links: the paper's accounting."""
    cost = {ActionKind.FORWARD: 1.0, ActionKind.BACKWARD: backward, ActionKind.BACKWARD_INPUT: 1.0,
            ActionKind.BACKWARD_WEIGHT: 1.0}
    return max(e.end for e in run_dataflow(schedule, lambda a: cost.get(a.kind, 0.0)))


def in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches forwarded whose (weight) backward is not done."""
    out = []
    for actions in schedule.stages:
        held = peak = 0
        for a in actions:
            held += (a.kind is ActionKind.FORWARD) - (a.kind in (ActionKind.BACKWARD,
                                                                 ActionKind.BACKWARD_WEIGHT))
            peak = max(peak, held)
        out.append(peak)
    return out


@pytest.mark.parametrize("k,m", [(1, 1), (2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_zb_h1_is_valid_round_trips_and_suits_in_order_backends(k: int, m: int, mode: str) -> None:
    for ahead in (False, True):
        s = make_schedule("zb-h1", k, m, mode, ahead)
        s.validate()
        s.check_link_order()
        assert Schedule.from_text(s.to_text()) == s


@pytest.mark.parametrize("k,m", [(2, 2), (2, 4), (4, 4), (8, 8)])
def test_zb_h1_reaches_the_papers_bubble_with_1f1b_peak_memory(k: int, m: int) -> None:
    # Qi et al. 2024, section 3.1: with T_F = T_B = T_W the 1F1B bubble is (p-1)(T_F+T_B+T_W) = 3(K-1)
    # units, ZB-H1's (p-1)(T_F+T_B-T_W) = K-1; each step does 3M units of work per stage.
    zb, ofob = make_schedule("zb-h1", k, m, "never"), make_schedule("1f1b", k, m, "never")
    assert unit_span(ofob) == 3 * m + 3 * (k - 1)
    assert unit_span(zb) == 3 * m + (k - 1)
    # the peak over stages of micro-batches held is 1F1B's (stage 0's: min(K, M))
    assert max(in_flight(zb)) == max(in_flight(ofob)) == min(k, m)


def test_zb_h1_reaches_the_bound_for_every_m_at_least_k() -> None:
    # the paper's handcrafted order: 3M + K - 1 units, the least any order takes (stage K-1 starts
    # K-1 units late and then has 3M units of work), with 1F1B's memory, for every M >= K; the
    # list-scheduling order it replaced took 29 units at K=4, M=8
    for k in range(1, 9):
        for m in range(k, 3 * k + 3):
            zb = make_schedule("zb-h1", k, m, "never")
            assert unit_span(zb) == 3 * m + k - 1, (k, m)
            assert max(in_flight(zb)) == k
    for k, m in [(4, 8), (8, 16), (8, 32)]:
        assert unit_span(make_schedule("zb-h1", k, m, "never")) - 3 * m == k - 1 < unit_span(
            make_schedule("1f1b", k, m, "never")) - 3 * m


@pytest.mark.parametrize("text,message", [
    ("stage 0: F0 I0 A U", r"W0 is missing"),
    ("stage 0: F0 W0 I0 A U", r"I0 comes before W0|W0 comes before I0"),
    ("stage 0: F0 I0 A U W0", r"must end with AGREE|after the AGREE"),
    ("stage 0: F0 B0 I0 W0 A U", r"both a BACKWARD"),
    ("stage 0: F0 I0 R0 W0 A U", r"I0 comes before R0"),
])
def test_split_backward_rules_are_enforced(text: str, message: str) -> None:
    s = Schedule.from_text(f"schedule broken stages=1 micro_batches=1 training=1\n{text}")
    with pytest.raises(ScheduleError, match=message) as info:
        s.validate()
    assert "<-- ERROR" in str(info.value)


def test_send_of_input_gradient_must_follow_i() -> None:
    text = textwrap.dedent("""
        schedule broken stages=2 micro_batches=1 training=1
        stage 0: F0 sa0 rg0 I0 W0 A U
        stage 1: ra0 F0 sg0 I0 W0 A U
        """)
    with pytest.raises(ScheduleError, match=r"sg0 comes before I0"):
        Schedule.from_text(text).validate()


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_zb_h1_trains_equal_to_plain_training(kind: str, mode: str) -> None:
    build, loss_fn = MODELS[kind]
    batches = [data(kind, seed=3 + step) for step in range(3)]
    for i, (k, m) in enumerate([(2, 3), (3, 7), (4, 4)]):
        # Adam only on the MLP: the conv model's bias before BatchNorm and the transformer's key bias
        # have gradients that are rounding noise (BatchNorm and softmax cancel them), and Adam scales
        # noise up to lr-sized steps of either sign, so any change of summation order (1F1B's too)
        # moves them by more than rtol.
        opt = adam if i % 2 and kind == "mlp" else sgd_momentum
        assert_same_training(build(), None, None, loss_fn, partitions=k, micro_batches=m, checkpoint=mode,
                             batches=batches, optimizer=opt, atol=1e-5,
                             schedule="zb-h1", recompute_ahead=bool(i % 2))


class SharedBranch(nn.Module):
    """A parameter whose gradient path never meets the input's (a learned bias added to the
    output): the split cannot group it, and the executor falls back to one full backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bias = nn.Linear(4, 4), nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.bias.tanh()


def test_zb_h1_with_parameters_the_split_cannot_group() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(3, 4), SharedBranch(), nn.ReLU(), SharedBranch(), nn.Linear(4, 2)]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 3, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(2)]
    assert_same_training(layers, None, None, nn.CrossEntropyLoss(), partitions=3, micro_batches=3,
                         checkpoint="never", batches=batches, schedule="zb-h1")


# Distributed: the same checks as tests/distributed/test_equivalence.py (each rank compares its cell
# with a local GPipe and the reference, two steps) on ZB-H1 configurations.
ZB_CONFIGS = {2: [("mlp", 4, "never", False, "zb-h1"), ("transformer", 3, "always", True, "zb-h1"),
                  ("conv", 3, "except_last", False, "zb-h1"),
                  # zb-v: 2K chunks in a V, chunks K-1 and K on one process
                  ("mlp", 4, "never", False, "zb-v"), ("transformer", 3, "except_last", True, "zb-v"),
                  ("conv", 2, "always", False, "zb-v")],
              3: [("mlp", 5, "except_last", True, "zb-h1"), ("conv", 4, "always", False, "zb-v"),
                  # the split on the last micro-batches only (GPipe(split_backwards=n))
                  ("transformer", 4, "never", False, "zb-h1", 1),
                  ("conv", 5, "except_last", False, "zb-v", 2)]}


def check_zb_configs(k: int) -> list[str]:
    """Runs in every stage process."""
    import tests.distributed.test_equivalence as dist_eq
    dist_eq.CONFIGS = ZB_CONFIGS
    return dist_eq.check_configs(k)


@pytest.mark.parametrize("k", [2, 3])
def test_distributed_runtime_runs_zb_h1_unchanged(k: int) -> None:
    from gpipe_repro.distributed import launch_local
    results = launch_local(check_zb_configs, k, k, timeout=30)
    assert len(results) == k and all(len(r) == len(ZB_CONFIGS[k]) for r in results)


@pytest.mark.parametrize("checkpoint,split", [("never", None), ("never", 1)])
def test_memory_planner_replays_zb_h1_within_5_percent_of_the_real_step(checkpoint: str,
                                                                       split: int | None) -> None:
    from gpipe_repro.memory.trace import trace_step
    from tests.memory.test_planner import _planner, _workloads
    w, planner = _workloads()["transformer"], _planner("transformer")
    real = trace_step(w.layers, w.sample, w.target, w.loss_fn, 2, 8, checkpoint, balance=[3, 3],
                      schedule="zb-h1", fake=False, split_backwards=split)
    plan = planner.plan(2, 8, checkpoint, balance=[3, 3], schedule="zb-h1", split_backwards=split)
    for s, r in zip(plan.stages, real.stages):
        assert abs(s.peak - s.parts.get("data", 0) - r.peak) <= 0.05 * r.peak, (s.stage, s.peak, r.peak)


def test_rendered_and_simulated_from_split_costs() -> None:
    from gpipe_repro.sim.links import LinkModel
    from gpipe_repro.sim.simulator import PipelineCosts, simulate
    k, m = 4, 8
    ones = [[1.0] * m for _ in range(k)]
    twos = [[2.0] * m for _ in range(k)]
    zeros = [[0.0] * m for _ in range(k - 1)]
    costs = PipelineCosts(ones, ones, ones, twos, [0.0] * k, zeros, zeros, backward_input=ones)
    link = LinkModel("instant", latency=0.0, bandwidth=1.0)
    sims = {name: simulate(make_schedule(name, k, m, "never"), costs, link, batch_size=m)
            for name in ("1f1b", "zb-h1")}
    # stage 0's I is free (nothing to send) and its W the whole backward, so zb-h1 can only beat
    # the unit-cost count of test_zb_h1_reaches_the_papers_bubble_with_1f1b_peak_memory
    assert sims["zb-h1"].step_time <= unit_span(make_schedule("zb-h1", k, m, "never"))
    assert sims["zb-h1"].step_time < sims["1f1b"].step_time == 3 * m + 3 * (k - 1)
    assert sims["zb-h1"].breakdown["computation"] > sims["1f1b"].breakdown["computation"]
    picture = make_schedule("zb-h1", 2, 2, "never").render()
    assert "I0" in picture and "W1" in picture



def test_autoplan_chooses_among_schedules_with_each_schedules_memory_plan() -> None:
    from gpipe_repro.memory.autoplan import search
    from gpipe_repro.sim.links import LinkModel
    from tests.memory.test_planner import _planner
    planner = _planner("transformer")
    link = LinkModel("instant", latency=0.0, bandwidth=1e12)
    cands = search(planner, 2, 1e12, link, 1e9, micro_batches=[8], checkpoints=("never",),
                   schedules=["gpipe", "1f1b", "zb-h1"])
    by = {(c.partitions, c.schedule): c for c in cands}
    assert {s for _, s in by} == {"gpipe", "1f1b", "zb-h1"}
    # the memory plan is the schedule's own: 1F1B holds fewer micro-batches than fill-drain
    assert by[(2, "1f1b")].max_peak < by[(2, "gpipe")].max_peak
    # at K=2, M=8 with compute-bound costs, zero-bubble is the fastest pipeline
    assert by[(2, "zb-h1")].throughput > by[(2, "1f1b")].throughput
    assert by[(2, "zb-h1")].throughput > by[(2, "gpipe")].throughput


def test_zb_h1_global_clipping_reads_every_w() -> None:
    # AGREE's global gradient norm must include every W's gradients: the validator puts all W before A
    build, loss_fn = MODELS["mlp"]
    batches = [data("mlp", seed=3 + step) for step in range(2)]
    assert_same_training(build(), None, None, loss_fn, partitions=3, micro_batches=4, checkpoint="never",
                         batches=batches, schedule="zb-h1", clip_grad_norm=0.05, atol=1e-5)


# In-place layers inside a cell, under the split's deferred weight gradients.
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
@pytest.mark.parametrize("k", [2, 3])
def test_zb_h1_with_inplace_layers_inside_cells(mode: str, k: int) -> None:
    from tests.engine.test_inplace import images, resnet, vgg
    batches = [images(s) for s in range(3)]
    for build in (resnet, vgg):     # SGD: a conv bias before BatchNorm has a gradient of rounding
        assert_same_training(build(), None, None, nn.CrossEntropyLoss(), partitions=k,  # noise
                             micro_batches=3, checkpoint=mode, batches=batches,
                             optimizer=sgd_momentum, atol=1e-5, schedule="zb-h1")


def test_zb_h1_inplace_that_starts_late_inside_a_cell_trains_as_plain_pytorch() -> None:
    """A layer inside a cell that starts modifying its input (a linear layer's output) in place:
    plain PyTorch trains through it, and so does the split (its forward keeps no autograd leaf
    inside a cell for the in-place operation to trip on)."""
    from tests.engine.test_inplace import LateInplace
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), LateInplace(after=2), nn.Linear(4, 1)]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]
    assert_same_training(layers, None, None, nn.MSELoss(), partitions=2, micro_batches=2,
                         checkpoint="never", balance=[1, 3], batches=batches, schedule="zb-h1")


class _Triple(nn.Module):
    """Returns a tuple: a new tensor, its own input unchanged and an integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.lin(x), x, torch.argmax(x, dim=1)


class _UseTriple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.emb = nn.Linear(4, 4), nn.Embedding(4, 4)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b, i = t
        return self.lin(a) + b + self.emb(i)


class _Constant(nn.Module):
    """An output that does not depend on the input (no gradient flows below it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x.detach(), 2.0)


@pytest.mark.parametrize("layers", [
    lambda: [nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 4), nn.Flatten(), nn.Identity(), nn.Linear(4, 2)],
    lambda: [nn.Linear(4, 4), _Triple(), _UseTriple(), nn.Tanh(), nn.Linear(4, 2)],
    lambda: [nn.Linear(4, 4), nn.Linear(4, 4), _Constant(), nn.Linear(4, 4), nn.Linear(4, 2)],
], ids=["identity-and-views", "tuple-with-input-and-integers", "constant"])
@pytest.mark.parametrize("mode", ["never", "always"])
def test_zb_h1_cuts_at_any_kind_of_layer_boundary(layers: Any, mode: str) -> None:
    """The split's cuts at every layer boundary: a layer returning its input (Identity) or a view
    of it (Flatten), a tuple carrying its input and an integer tensor, an output that does not
    depend on the input."""
    torch.manual_seed(0)
    built = layers()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(2)]
    for balance in (None, [1, len(built) - 1]):
        assert_same_training(built, None, None, nn.CrossEntropyLoss(), partitions=2, micro_batches=3,
                             checkpoint=mode, batches=batches, optimizer=sgd_momentum, schedule="zb-h1",
                             balance=balance)


class _TiedHead(nn.Module):
    """An output layer using an earlier layer's weight without registering it (the
    ``self._ref = [owner]`` idiom that keeps state_dict free of duplicates)."""

    def __init__(self, owner: nn.Linear) -> None:
        super().__init__()
        self._ref = [owner]
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self._ref[0].weight, self.bias)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v", "dualpipe-v"])
def test_split_reaches_a_weight_a_layer_uses_without_registering_it(schedule: str) -> None:
    """Each layer's split takes every cell parameter its graph reaches, not only its own: the
    weight half of the tied head's micro-batches must reach the owner's weight."""
    torch.manual_seed(0)
    owner = nn.Linear(4, 4)
    layers = [nn.Linear(4, 4), owner, nn.Tanh(), _TiedHead(owner), nn.Linear(4, 2)]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(2)]
    assert_same_training(layers, None, None, nn.CrossEntropyLoss(), partitions=2, micro_batches=3,
                         checkpoint="never", batches=batches, optimizer=sgd_momentum, schedule=schedule,
                         balance=[1, 4])


class _Gate(nn.Module):
    """Two Linears read the layer's input (a gated MLP; BERT's q, k and v do the same)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * torch.sigmoid(self.b(x))


class _Fp32Norm(nn.Module):
    """LayerNorm in fp32 (as CUDA autocast runs layer_norm): the next layer gets an fp32 value."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x.float())


def test_bf16_split_sums_a_cut_values_gradients_in_fp32_as_plain_autocast() -> None:
    """A cell's input is an autograd leaf; autocast caches the cast of leaves that require grad (as
    it does a weight's), so an fp32 value read by two Linears would be cast once and its two
    gradients summed in bf16. Deferred under autocast, the result equals plain autocast training
    within the bf16 tolerance of tests/engine/test_steps.py."""
    from tests.engine.test_steps import batch
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16), _Fp32Norm(16), _Gate(16), nn.Linear(16, 3)]
    assert_same_training(layers, None, None, nn.CrossEntropyLoss(), partitions=2, micro_batches=2,
                         checkpoint="except_last", balance=[1, 3], batches=[batch(s) for s in range(3)],
                         optimizer=sgd_momentum, precision="bf16", rtol=1e-4, atol=1e-4,
                         schedule="zb-h1")


@pytest.mark.parametrize("schedule,partitions", [("zb-h1", 2), ("zb-v", 4), ("dualpipe-v", 2), ("gpipe", 2)])
def test_split_reaches_every_leaf_plain_training_reaches(schedule: str, partitions: int) -> None:
    """The weight half differentiates every leaf the graph reaches, as plain backward does: another
    cell's parameters read by the loss (an L2 regularizer over the whole model), a tensor a layer
    captured, and the caller's input when it requires grad (stage 0's whole backward runs at W)."""
    import copy
    torch.manual_seed(0)
    captured = torch.randn(8, requires_grad=True)

    class Shifted(nn.Module):
        def __init__(self, shift: torch.Tensor) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self._shift = [shift]                 # not a parameter: a leaf the layer reads

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self._shift[0]
    base = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), Shifted(captured), nn.Tanh(), nn.Linear(8, 4)]
    x0, y = torch.randn(6, 8), torch.randn(6, 4)

    def regularized(model: nn.Module) -> Any:
        def loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(out, t) + 1e-2 * sum(p.pow(2).sum() for p in model.parameters())
        return loss

    def run(layers: list[nn.Module], pipe: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        model = nn.Sequential(*layers)
        x = x0.clone().requires_grad_()
        shift = layers[3]._shift[0]
        shift.grad = None
        if pipe is None:
            regularized(model)(model(x), y).backward()
        else:
            pipe.train_step(x, y)
        assert x.grad is not None and shift.grad is not None
        return [p.grad.clone() for p in model.parameters()] + [shift.grad.clone()], x.grad

    ref_layers = copy.deepcopy(base)
    ref_grads, ref_x = run(ref_layers, None)
    layers = copy.deepcopy(base)
    layers[3]._shift = ref_layers[3]._shift       # the same leaf
    from gpipe_repro import GPipe
    pipe = GPipe(layers, partitions=partitions, micro_batches=2, schedule=schedule,
                 loss_fn=regularized(nn.Sequential(*layers)), optimizer=None,
                 balance=[2, 2, 1, 1] if partitions == 4 else [3, 3])
    grads, xg = run(layers, pipe)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xg, ref_x, rtol=1e-5, atol=1e-6)


class _WithPenalty(nn.Module):
    """Returns its output and, beside it, a penalty on its own weight that does not depend on the
    input (one per row, so that it is micro-batched): the weight's gradient comes through both."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.lin.weight.pow(2).sum() * torch.ones(x.shape[0])


class _AddPenalty(nn.Module):
    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, penalty = value
        return h + penalty[:, None]


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_silent_split_lost_a_weights_gradient_through_an_output_that_skips_the_input(schedule: str) -> None:
    """A layer's weight reaches its outputs by two paths, one that meets the input's path and one
    that does not (a penalty on the weight passed along beside the activation). The split grouped
    the weight by where its first path met the input's and started the weight half there, so the
    penalty's share of the weight's gradient was lost with no error; the split now runs such a
    layer's backward whole, at once."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), _WithPenalty(4), _AddPenalty(), nn.Tanh(), nn.Linear(4, 2)]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(2)]
    assert_same_training(layers, None, None, nn.CrossEntropyLoss(), partitions=2, micro_batches=3,
                         checkpoint="never", batches=batches, optimizer=sgd_momentum, schedule=schedule,
                         balance=[1, 4] if schedule == "zb-h1" else None)


class GatedWithHook(nn.Module):
    """A linear gated by a parameter (its join node is a multiplication, no weight kernel's), with a
    gradient hook on the gated activation that records what it sees and doubles it."""

    def __init__(self, seen: list[float]) -> None:
        super().__init__()
        self.lin, self.gate, self.seen = nn.Linear(4, 4), nn.Parameter(torch.linspace(0.5, 1.5, 4)), seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.gate
        if h.requires_grad:
            h.register_hook(self._hook)
        return torch.tanh(h)

    def _hook(self, g: torch.Tensor) -> torch.Tensor:
        self.seen.append(round(float(g.norm()), 6))
        return g * 2


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_hook_rerun_the_weight_half_ran_an_activations_gradient_hook_a_second_time(schedule: str) -> None:
    """The weight half started autograd at the join node, which ran the hooks on the tensor it made
    again: a gradient hook ran twice per micro-batch, the second time on what it had returned
    (gradients stayed right). The join node's backward is now called directly. Reference: plain
    PyTorch on each micro-batch, the same hook, no engine code."""
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    seen: list[float] = []
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), GatedWithHook(seen), nn.Linear(4, 4), nn.Tanh()]
    ref = [copy.deepcopy(layer) for layer in layers]
    plain: list[float] = []
    ref[1].seen = plain
    for layer in [*layers, *ref]:
        layer.double()
    model = nn.Sequential(*ref)
    for rows in (slice(0, 4), slice(4, 8)):
        (nn.functional.mse_loss(model(x[rows]), y[rows]) / 2).backward()
    k = 2 if schedule == "zb-h1" else 4
    pipe = GPipe(layers, partitions=k, micro_batches=2, schedule=schedule, checkpoint="never",
                 balance=[1] * 4 if k == 4 else [1, 3], loss_fn=nn.MSELoss(), optimizer=None)
    pipe.train_step(x, y)
    assert sorted(seen) == sorted(plain) and len(seen) == 2
    for p, q in zip(pipe.unpartitioned().parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


class ScaleFn(torch.autograd.Function):
    """x * w by a custom Function: its backward node cannot be called directly, so its group's weight
    half starts autograd at the node (PyTorch pipelining's way)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


def test_a_custom_functions_join_node_trains_equal_to_plain_training() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(ScaleFn.apply(x, self.w))
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4).double(), Scaled(), nn.Linear(4, 4).double()]
    model = nn.Sequential(*copy.deepcopy(layers))
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    nn.functional.mse_loss(model(x), y).backward()
    pipe = GPipe(layers, partitions=2, micro_batches=3, schedule="zb-h1", checkpoint="never",
                 balance=[1, 2], loss_fn=nn.MSELoss(), optimizer=None)
    pipe.train_step(x, y)
    for p, q in zip(pipe.unpartitioned().parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_post_accumulate_grad_hooks_were_skipped_by_the_weight_half(schedule: str) -> None:
    """The weight half captured each parameter's gradient and added it into .grad by hand, so a
    post-accumulate-grad hook (an optimizer stepping in the backward, gradient logging) never ran
    on the cells whose backward is split: a hook halving p.grad left zb-h1's gradient at twice
    plain training's. It now goes through AccumulateGrad, as plain training's backward does.
    Reference: plain PyTorch, one backward per micro-batch, the same hooks."""
    def build(calls: list[str]) -> list[nn.Module]:
        torch.manual_seed(0)
        layers = [nn.Linear(4, 4), nn.Tanh(), GatedWithHook([]), nn.Linear(4, 3)]
        for name, p in [("weight", layers[3].weight), ("gate", layers[2].gate)]:
            def halve(q: torch.Tensor, name: str = name) -> None:
                calls.append(name)
                q.grad.mul_(0.5)
            p.register_post_accumulate_grad_hook(halve)
        return [layer.double() for layer in layers]
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    plain_calls: list[str] = []
    model = nn.Sequential(*build(plain_calls))
    for rows in (slice(0, 3), slice(3, 6)):
        (nn.functional.mse_loss(model(x[rows]), y[rows]) / 2).backward()
    calls: list[str] = []
    k = 2 if schedule == "zb-h1" else 4
    pipe = GPipe(build(calls), partitions=k, micro_batches=2, schedule=schedule, checkpoint="never",
                 balance=[2, 2] if k == 2 else [1, 1, 1, 1], loss_fn=nn.MSELoss(), optimizer=None)
    pipe.train_step(x, y)
    assert sorted(calls) == sorted(plain_calls) and len(calls) == 4
    for p, q in zip(pipe.unpartitioned().parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_silent_memory_plan_counted_the_input_halfs_gradients_once_per_input_half() -> None:
    """Under ZB-H1 stage s runs s + 1 input halves before its first weight half; the gradients an
    input half makes (a norm's: not deferred) were added at each of them, over-estimating the plan."""
    from gpipe_repro.memory.compose import GRADS, walk_stage
    from gpipe_repro.memory.profile import profile_layer
    from gpipe_repro.models.signature import value_sig
    sig = value_sig(torch.empty(8, 64, requires_grad=True))
    cell = [profile_layer(nn.LayerNorm(64), sig), profile_layer(nn.Linear(64, 64), sig)]
    assert cell[0].deferred_grad_bytes == 0 and cell[1].deferred_grad_bytes == cell[1].grad_bytes > 0
    memory = walk_stage(make_schedule("zb-h1", 4, 8, "never"), 2, [cell] * 8, {}, 0, timeline=True)
    assert memory.parts.get(GRADS, 0) <= sum(p.grad_bytes for p in cell)
