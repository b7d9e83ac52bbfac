"""The partitioner: optimal against brute force, and what exactness buys on skewed costs."""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe_repro.engine.partition import cell_costs, partition


def all_balances(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        yield [b - a for a, b in zip(edges, edges[1:])]


costs_st = st.lists(st.floats(min_value=0.0, max_value=100.0, allow_nan=False), min_size=1, max_size=9)


@settings(max_examples=150, deadline=None)
@given(costs=costs_st, data=st.data())
def test_bottleneck_is_optimal(costs: list[float], data) -> None:
    k = data.draw(st.integers(1, len(costs)))
    balance = partition(costs, k, "bottleneck")
    assert len(balance) == k and min(balance) >= 1 and sum(balance) == len(costs)
    best = min(max(cell_costs(costs, b)) for b in all_balances(len(costs), k))
    assert max(cell_costs(costs, balance)) <= best * (1 + 1e-9) + 1e-12


@settings(max_examples=150, deadline=None)
@given(costs=costs_st, data=st.data())
def test_variance_is_optimal(costs: list[float], data) -> None:
    k = data.draw(st.integers(1, len(costs)))
    balance = partition(costs, k, "variance")
    sq = lambda b: sum(c * c for c in cell_costs(costs, b))  # noqa: E731
    best = min(sq(b) for b in all_balances(len(costs), k))
    assert sq(balance) <= best * (1 + 1e-9) + 1e-9


@settings(max_examples=150, deadline=None)
@given(costs=costs_st, data=st.data())
def test_memory_cap_is_honoured_and_optimal_under_it(costs: list[float], data) -> None:
    n = len(costs)
    k = data.draw(st.integers(1, n))
    memory = data.draw(st.lists(st.floats(0.0, 10.0), min_size=n, max_size=n))
    cap = data.draw(st.floats(0.0, 40.0))
    feasible = [b for b in all_balances(n, k) if max(cell_costs(memory, b)) <= cap]
    if not feasible:
        with pytest.raises(ValueError, match="cap|fit"):
            partition(costs, k, "bottleneck", memory=memory, memory_cap=cap)
        return
    balance = partition(costs, k, "bottleneck", memory=memory, memory_cap=cap)
    assert max(cell_costs(memory, balance)) <= cap + 1e-9
    best = min(max(cell_costs(costs, b)) for b in feasible)
    assert max(cell_costs(costs, balance)) <= best * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("objective", ["greedy", "equal"])
@given(costs=costs_st, data=st.data())
@settings(max_examples=50, deadline=None)
def test_heuristics_give_valid_balances(objective: str, costs: list[float], data) -> None:
    k = data.draw(st.integers(1, len(costs)))
    balance = partition(costs, k, objective)
    assert len(balance) == k and min(balance) >= 1 and sum(balance) == len(costs)


def test_exact_beats_equal_and_greedy_on_a_skewed_model() -> None:
    """A cheap stem, heavy middle and cheap head (AmoebaNet's shape: cost grows after reductions)."""
    costs = [1, 1, 1, 1, 2, 2, 2, 8, 8, 8, 8, 8, 3, 1]
    k = 4
    bottleneck = {o: max(cell_costs(costs, partition(costs, k, o))) for o in
                  ("bottleneck", "variance", "greedy", "equal")}
    print("\nslowest cell by objective:", bottleneck)
    assert bottleneck["bottleneck"] == 16
    # equal layers: [4,4,3,3] -> cells 4,14,24,12; lingvo's share cut: [7,2,1,4] -> 10,16,8,20.
    assert bottleneck["equal"] == 24 and bottleneck["greedy"] == 20
    # Pipeline throughput is set by the slowest cell: the exact cut is 1.5x faster than an equal-layer
    # split and 1.25x faster than the cumulative-share heuristic here.
    assert bottleneck["equal"] / bottleneck["bottleneck"] == 1.5
    assert bottleneck["greedy"] / bottleneck["bottleneck"] == 1.25


def test_errors() -> None:
    with pytest.raises(ValueError, match="partitions=5 is larger than the number of layers"):
        partition([1, 2, 3], 5)
    with pytest.raises(ValueError, match="layer 1 alone needs"):
        partition([1, 1], 2, memory=[1, 9], memory_cap=5)
    with pytest.raises(ValueError, match="does not fit in 2 cells"):
        partition([1, 1, 1], 2, memory=[3, 3, 3], memory_cap=4)


def test_large_problems_stay_exact_in_the_bottleneck_and_even() -> None:
    """1665 layers on 128 devices (Transformer-1663): too big for the full DP; the windowed DP must
    still reach the optimal bottleneck and keep cells even (no [1, 13, 1, 13] front-loading)."""
    costs = [5.0] + [1.0] * 1663 + [5.0]
    balance = partition(costs, 128)
    cells = cell_costs(costs, balance)
    assert max(cells) == 14.0  # ceil(1673 / 128)
    assert min(cells) >= 13.0


@pytest.mark.parametrize("objective", ["bottleneck", "variance", "greedy", "equal"])
def test_cell_count_holds_when_sum_is_compensated(objective: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.12's sum() of floats is compensated (as math.fsum): the costs below sum one ulp under
    their left-to-right total, and K=1 came back as two cells (found by hypothesis on 3.12). The
    module's sum is replaced by fsum here so that this Python reproduces 3.12."""
    import math

    import gpipe_repro.engine.partition as module
    monkeypatch.setattr(module, "sum", math.fsum, raising=False)
    costs = [28.496832335469918, 99.73846150382242, 1.496832335469918]
    assert math.fsum(costs) != (costs[0] + costs[1]) + costs[2]       # the case is the one seen
    for k in range(1, len(costs) + 1):
        balance = partition(costs, k, objective)
        assert len(balance) == k and min(balance) >= 1 and sum(balance) == len(costs), (k, balance)


def test_default_cost_is_measured_time_with_a_sample_else_params(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchgpipe's balance_by_time when a sample is given: a layer's parameters say little of its
    time. The timing is patched (no wall clock): the parameter-less layers are the slow ones."""
    import torch
    from torch import nn

    from gpipe_repro import GPipe
    from gpipe_repro.engine import layer_costs

    torch.manual_seed(0)
    layers = [nn.Linear(8, 64), nn.Tanh(), nn.Tanh(), nn.Tanh(), nn.Linear(64, 8)]
    seconds = {id(layers[0]): 1.0, id(layers[4]): 1.0, id(layers[1]): 5.0, id(layers[2]): 5.0,
               id(layers[3]): 5.0}
    monkeypatch.setattr(layer_costs, "measure_layer",
                        lambda layer, x, *args, **kwargs: (seconds[id(layer)], 0.0))
    x = torch.randn(4, 8)

    def cut(**kwargs: object) -> list[int]:
        return GPipe(layers, partitions=2, loss_fn=nn.MSELoss(), optimizer=None, **kwargs).balance

    by_time, by_params = cut(cost="time", sample=x), cut(cost="params")
    assert by_time != by_params
    assert cut(sample=x) == by_time
    assert cut() == by_params


def test_time_costs_interleave_the_layers_round_by_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round times every layer once, forward order then reverse; a layer's cost is the median
    of its rounds, so a slow spell of the host lands on every layer alike."""
    import torch
    from torch import nn

    from gpipe_repro.engine import layer_costs

    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4, bias=False)]     # unlike: not pooled
    calls: list[int] = []
    spell = iter([9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0])

    def timed(layer: nn.Module, x: object, *args: object, **kwargs: object) -> tuple[float, float]:
        assert kwargs.get("repeats") == 1
        calls.append(next(i for i, m in enumerate(layers) if m is layer))
        return next(spell), 0.5
    monkeypatch.setattr(layer_costs, "measure_layer", timed)
    costs = layer_costs.layer_costs(layers, "time", torch.randn(2, 4), repeats=5)
    assert calls == [0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0, 0, 1, 2]
    assert costs == [1.5, 1.5, 1.5]          # the two slow readings are each one layer's outlier
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        layer_costs.measure_layers(layers, [None] * 3, rounds=0)


def test_layers_alike_share_one_time_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Transformer's blocks cost the same: their readings are pooled, so the host's noise cannot
    set them apart and move the cut; a layer of another size keeps its own cost."""
    import torch
    from torch import nn

    from gpipe_repro.engine import layer_costs

    layers = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 8)]
    reading = {id(layers[0]): 1.0, id(layers[1]): 3.0, id(layers[2]): 5.0}
    monkeypatch.setattr(layer_costs, "measure_layer",
                        lambda layer, x, *args, **kwargs: (reading[id(layer)], 0.0))
    assert layer_costs.layer_costs(layers, "time", torch.randn(2, 4), repeats=5) == [2.0, 2.0, 5.0]
    x = torch.randn(2, 4)
    assert layer_costs.likeness(layers[0], x) == layer_costs.likeness(layers[1], x)
    assert layer_costs.likeness(layers[0], x) != layer_costs.likeness(layers[0], torch.randn(3, 4))
    assert layer_costs.likeness(layers[0], x) != layer_costs.likeness(nn.Linear(4, 4, bias=False), x)


def test_the_loss_is_measured_with_the_last_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPipe(sample=x, sample_target=y, loss_fn=...) times the loss with the last layer (the last
    cell runs it), and only there; that layer then shares its cost with no layer alike."""
    import torch
    from torch import nn

    from gpipe_repro.engine import layer_costs

    layers = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]       # alike: pooled without a loss
    seen: list[tuple[int, object]] = []

    def timed(layer: nn.Module, x: object, *args: object, loss: object = None,
              **kw: object) -> tuple[float, float]:
        seen.append((next(i for i, m in enumerate(layers) if m is layer), loss))
        return (1.0, 1.0) if loss is None else (1.0, 7.0)
    monkeypatch.setattr(layer_costs, "measure_layer", timed)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    loss_fn = nn.MSELoss()
    assert layer_costs.layer_costs(layers, "time", x, repeats=3) == [2.0, 2.0, 2.0]
    seen.clear()
    assert layer_costs.layer_costs(layers, "time", x, repeats=3, loss=(loss_fn, y)) == [2.0, 2.0, 8.0]
    assert {i for i, loss in seen if loss is not None} == {2}
    # a loss module is copied to the measuring device, as the last stage holds it
    assert all(isinstance(loss[0], nn.MSELoss) and torch.equal(loss[1], y)  # type: ignore[index]
               for i, loss in seen if i == 2)


def test_a_costly_loss_moves_the_cut() -> None:
    """Counted, not timed: a loss with a large matmul makes the last layer the costly one, and the
    cut gives the last cell fewer layers than without the loss; the loss really runs, on the sample's
    targets, forward and backward, and a tensor of the caller's that it holds gets no gradient."""
    import torch
    from torch import nn

    from gpipe_repro import GPipe

    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(6)]
    weight = torch.randn(16, 4096, requires_grad=True)
    calls: list[torch.Tensor] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(y)
        return ((out @ weight).sum(dim=1) - y).square().mean()

    x, y = torch.randn(8, 16), torch.randn(8)

    def cut(**kw: object) -> list[int]:
        return GPipe(layers, partitions=2, cost="flops", sample=x, loss_fn=loss_fn, optimizer=None,
                     checkpoint="never", **kw).balance
    assert cut() == [3, 3]
    assert not calls
    assert cut(sample_target=y) == [5, 1]
    assert calls and all(t is y or torch.equal(t, y) for t in calls)
    assert weight.grad is None


@pytest.mark.parametrize("kwargs, match", [
    ({"sample_target": "y"}, "sample_target was given without sample"),
    ({"sample": "x", "sample_target": "y", "loss_fn": None}, "sample_target was given without loss_fn"),
    ({"sample": "x", "sample_target": "y3"}, "sample_target has 3 rows but sample has 2"),
])
def test_sample_target_errors_say_what_to_give(kwargs: dict[str, object], match: str) -> None:
    import torch
    from torch import nn

    from gpipe_repro import GPipe

    values = {"x": torch.randn(2, 4), "y": torch.randn(2, 4), "y3": torch.randn(3, 4)}
    args = {k: values.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    args.setdefault("loss_fn", nn.MSELoss())
    with pytest.raises(ValueError, match=match):
        GPipe([nn.Linear(4, 4), nn.Linear(4, 4)], partitions=2, optimizer=None, **args)


def test_timing_runs_the_loss_on_the_device_and_leaves_the_callers_tensors_alone() -> None:
    """The "time" path for real (one round): the loss runs on its targets, forward and backward
    through it into the layer (the layer's input gets its gradient), and neither a tensor the loss
    captured nor the targets change."""
    import torch
    from torch import nn

    from gpipe_repro.engine import layer_costs

    scale = torch.ones(4, requires_grad=True)
    runs: list[torch.Tensor] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        runs.append(out)
        return ((out * scale - y) ** 2).mean()
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    y_before = y.clone()
    costs = layer_costs.layer_costs(layers, "time", x, repeats=1, loss=(loss_fn, y))
    assert len(costs) == 2 and all(c > 0 for c in costs)
    assert runs and all(r.requires_grad for r in runs)
    assert scale.grad is None and torch.equal(y, y_before)
    assert all(p.grad is None for layer in layers for p in layer.parameters())


def test_sample_target_is_refused_by_a_cost_that_does_not_run_the_loss() -> None:
    import torch
    from torch import nn

    from gpipe_repro import GPipe

    for cost, shown in (("params", "cost='params'"), ("activations", "cost='activations'"),
                        ([1.0, 2.0], "a list of costs")):
        with pytest.raises(ValueError, match=f"used only by cost='time' or 'flops'.*{shown}"):
            GPipe([nn.Linear(4, 4), nn.Linear(4, 4)], partitions=2, optimizer=None, loss_fn=nn.MSELoss(),
                  cost=cost, sample=torch.randn(2, 4), sample_target=torch.randn(2, 4))


def test_zero_bubble_auto_cut_balanced_whole_backwards_left_the_split_cells_the_bottleneck(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GPipe(sample=x, schedule="zb-h1") cuts for what each cell runs: the first by whole backwards
    (its input takes no gradient), the others by both halves of the split. Ten alike layers whose
    split backward costs 2.0 against 1.0 whole (forward 1.0): [5, 5] left the second cell at 15
    against 10; the cut of what each cell runs is [6, 4] (12 against 12)."""
    import torch
    from torch import nn

    from gpipe_repro import GPipe
    from gpipe_repro.engine import layer_costs

    def timed(layer: nn.Module, x: object, *args: object, split: bool = False,
              **kw: object) -> tuple[float, float]:
        return 1.0, 2.0 if split else 1.0
    monkeypatch.setattr(layer_costs, "measure_layer", timed)
    layers = [nn.Linear(4, 4) for _ in range(10)]
    x = torch.randn(4, 4)

    def cut(schedule: str) -> list[int]:
        return GPipe(layers, partitions=2, micro_batches=2, loss_fn=nn.MSELoss(), optimizer=None,
                     sample=x, schedule=schedule).balance
    assert cut("zb-h1") == [6, 4]
    assert cut("1f1b") == cut("gpipe") == [5, 5]


def test_first_cell_costs_give_the_brute_force_bottleneck() -> None:
    from itertools import combinations

    rng = random.Random(3)
    for _ in range(60):
        n, k = rng.randint(1, 9), rng.randint(1, 4)
        if k > n:
            continue
        costs = [rng.uniform(0.0, 2.0) for _ in range(n)]
        first = [c * rng.uniform(0.3, 1.0) for c in costs]
        got = partition(costs, k, first=first)
        assert len(got) == k and sum(got) == n and min(got) >= 1

        def worst(b: list[int], costs: list[float] = costs, first: list[float] = first) -> float:
            cells = cell_costs(costs, b)
            cells[0] = sum(first[:b[0]])
            return max(cells)
        cuts = [[e - s for s, e in zip((0, *c), (*c, n))] for c in combinations(range(1, n), k - 1)]
        assert worst(got) <= min(worst(b) for b in cuts) * (1 + 1e-12)
    with pytest.raises(ValueError, match="bottleneck objective"):
        partition([1.0, 1.0], 2, "variance", first=[1.0, 1.0])
    with pytest.raises(ValueError, match="one cost >= 0 per layer"):
        partition([1.0, 1.0], 2, first=[1.0])


def test_measuring_the_split_backward_writes_no_gradient_outside_the_layer() -> None:
    """The split's timing runs the input and the weight half on a copy of the layer; a loss that
    reads a tensor of the caller's requiring a gradient (a closure's) keeps it untouched, and the
    layer given is not modified."""
    import torch
    from torch import nn

    from gpipe_repro.engine import layer_costs

    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    scale = torch.ones(2, requires_grad=True)
    x, y = torch.randn(3, 4), torch.randn(3, 2)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out * scale - target) ** 2).mean()
    before = [p.detach().clone() for p in layer.parameters()]
    f, b = layer_costs.measure_layer(layer, x, repeats=2, warmup=1, loss=(loss_fn, y), split=True)
    assert f > 0 and b > 0
    assert scale.grad is None
    assert all(p.grad is None and torch.equal(p, q) for p, q in zip(layer.parameters(), before))
    split, whole = layer_costs.split_layer_costs([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)], x,
                                                 repeats=1)
    assert len(split) == len(whole) == 3 and all(c > 0 for c in split + whole)


@pytest.mark.parametrize("schedule,split_backwards", [("1f1b", None), ("zb-h1", None), ("zb-h1", "auto")])
def test_silent_time_cut_timed_the_layers_on_the_cpu_for_a_model_on_another_device(
        monkeypatch: pytest.MonkeyPatch, schedule: str, split_backwards: str | None) -> None:
    """`cost="time"` (and the zero-bubble cut by split costs, and "auto") times the layers where the
    first cell will run: a CUDA model's cut was made from CPU timings, which rank layers differently."""
    import torch
    from torch import nn

    from gpipe_repro import GPipe
    from gpipe_repro.engine import layer_costs

    class Timed(Exception):
        pass

    seen: list[torch.device] = []

    def measure_layers(layers, inputs, device="cpu", **kwargs):  # type: ignore[no-untyped-def]
        seen.append(torch.device(device))
        raise Timed
    monkeypatch.setattr(layer_costs, "measure_layers", measure_layers)
    with pytest.raises(Timed):
        GPipe([nn.Linear(4, 4) for _ in range(4)], partitions=2, micro_batches=2, optimizer=None,
              schedule=schedule, split_backwards=split_backwards, sample=torch.randn(2, 4), cost="time",
              devices=["meta", "meta"])
    assert seen == [torch.device("meta")]


def test_silent_cut_attention_weighed_nothing_in_a_cut_by_flops() -> None:
    """`GPipe(cost="flops")` counts each layer's FLOPs with torch's counter, which sees none inside
    the fused attention kernel `scaled_dot_product_attention` runs on CPU tensors: attention
    layers weighed 0 and a Transformer was cut as if it were its projections alone. Reference: the
    products by hand (four attention layers against four Linear layers of equal FLOPs)."""
    import torch
    from torch import nn

    from gpipe_repro import GPipe

    n, t, heads, dh = 4, 32, 2, 8
    d = heads * dh

    class Attention(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = x.view(n, t, heads, dh).transpose(1, 2)
            return nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(n, t, d)

    # forward FLOPs of one attention layer: 2 products of 2 n heads t t dh; of a Linear(d, w) on n t
    # rows: 2 n t d w; equal at w = 2 t (bias-free)
    layers: list[nn.Module] = [Attention() for _ in range(4)]
    layers += [nn.Sequential(nn.Linear(d, 2 * t, bias=False), nn.Linear(2 * t, d, bias=False))
               for _ in range(2)]
    x = torch.randn(n, t, d)
    pipe = GPipe(layers, partitions=2, cost="flops", sample=x, loss_fn=lambda out, _: out.sum(),
                 optimizer=None, checkpoint="never")
    assert pipe.balance == [4, 2]


@pytest.mark.parametrize("kwargs, match", [
    ({"cost": [1, float("nan"), 1, 1]}, r"cost must be finite numbers >= 0; entry 1 is nan"),
    ({"cost": [1, float("inf"), 1, 1]}, r"entry 1 is inf"),
    ({"cost": [1, "a", 1, 1]}, r"cost: entry 1 is 'a', not a number"),
    ({"cost": [1, 2, 3], "balance": [2, 2]}, r"3 costs given for 4 layers"),
    ({"balance": [5, -1]}, r"holds a negative count of layers"),
    ({"cost": "time", "sample": "empty"}, r"sample has no rows"),
])
def test_silent_cut_a_nan_cost_or_an_empty_sample_cut_a_model_without_a_word(
        kwargs: dict[str, object], match: str) -> None:
    """A NaN cost compares false with everything: GPipe(cost=[1, nan, 1, 1]) cut [3, 1] silently;
    a cost list of the wrong length was ignored beside balance=, and layers were timed on a sample
    of no rows. Each is refused before any work, naming what to change."""
    import torch
    from torch import nn

    from gpipe_repro import GPipe

    args = {k: torch.randn(0, 4) if v == "empty" else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        GPipe([nn.Linear(4, 4) for _ in range(4)], partitions=2, optimizer=None, **args)
