"""Zero-bubble schedules splitting only their last micro-batches' backwards
(engine/schedule/partial_split.py, ``GPipe(split_backwards=n)``): valid for every count, equal per
parameter to plain training (the independent reference, tests/equivalence.py), the split forward
run only where the backward splits, and bad counts refused before any work."""
from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from gpipe_repro import GPipe
from gpipe_repro.engine import stage as stage_module
from gpipe_repro.engine.schedule import ActionKind, Schedule, make_schedule, split_last
from tests.engine.test_equivalence import MODELS, data
from tests.equivalence import assert_same_training, sgd_momentum

A = ActionKind


def _kinds(schedule: Schedule, stage: int) -> dict[int, set[ActionKind]]:
    out: dict[int, set[ActionKind]] = {}
    for a in schedule.stages[stage]:
        if a.kind in (A.BACKWARD, A.BACKWARD_INPUT, A.BACKWARD_WEIGHT) and a.microbatch is not None:
            out.setdefault(a.microbatch, set()).add(a.kind)
    return out


@pytest.mark.parametrize("name,cells,m", [("zb-h1", 2, 4), ("zb-h1", 4, 8), ("zb-v", 4, 4),
                                          ("zb-v", 4, 8), ("dualpipe-v", 4, 8), ("dualpipe-v", 6, 6)])
@pytest.mark.parametrize("mode", ["never", "except_last"])
def test_every_split_count_is_valid_and_splits_exactly_the_last_ones(name: str, cells: int, m: int,
                                                                       mode: str) -> None:
    full = make_schedule(name, cells, m, mode)
    for n in range(m + 1):
        s = make_schedule(name, cells, m, mode, split_backwards=n)
        s.validate()
        s.check_link_order()       # NCCL matches messages in order: the sends keep their order
        assert s.name == full.name and s.checkpointed(0) == full.checkpointed(0)
        for stage in range(cells):
            kinds, paper = _kinds(s, stage), _kinds(full, stage)
            assert set(kinds) == set(range(m))
            for mb, got in kinds.items():    # DualPipeV runs some backwards whole already
                want = paper[mb] if mb >= m - n else {A.BACKWARD}
                assert got == want, (name, n, stage, mb, got)
            # a whole backward stands where its input half stood: every other action keeps its order
            def rest(actions: tuple[Any, ...]) -> list[Any]:
                return [a for a in actions if a.kind not in (A.BACKWARD, A.BACKWARD_INPUT,
                                                             A.BACKWARD_WEIGHT)]
            assert rest(s.stages[stage]) == rest(full.stages[stage])
        if name != "dualpipe-v":
            assert s.split_share == pytest.approx(n / m)
    assert make_schedule(name, cells, m, mode, split_backwards=m) == full
    assert split_last(make_schedule("1f1b", 2, 4, mode), 0) == make_schedule("1f1b", 2, 4, mode)


def test_split_backwards_is_refused_where_it_means_nothing_or_is_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"split_backwards=1 is for the zero-bubble schedules .*"
                                         r"schedule='1f1b' runs whole backwards: leave split_backwards out"):
        make_schedule("1f1b", 2, 4, "never", split_backwards=1)
    with pytest.raises(ValueError, match=r"from 0 to M \(how many of the last micro-batches"):
        make_schedule("zb-h1", 2, 4, "never", split_backwards=-1)
    with pytest.raises(ValueError, match=r"from 0 to M = 4 .* got 5"):
        make_schedule("zb-h1", 2, 4, "never", split_backwards=5)
    build, loss_fn = MODELS["mlp"]
    for kwargs, message in [
            (dict(schedule="gpipe", split_backwards=0), "schedule='gpipe' runs whole backwards"),
            (dict(schedule="zb-h1", split_backwards=5), r"split_backwards=5 is more than micro_batches=4: "
                                                        "use at most 4"),
            (dict(schedule="zb-h1", split_backwards=True), "must be an integer"),
            (dict(schedule="zb-h1", split_backwards="all"), r"a count \(0 to micro_batches\), None .* or "
                                                            "'auto', got 'all'")]:
        with pytest.raises(ValueError, match=message):
            GPipe(build(), partitions=2, micro_batches=4, loss_fn=loss_fn, cost="params", **kwargs)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("schedule,cells,m,n", [("zb-h1", 2, 4, 1), ("zb-h1", 3, 5, 2), ("zb-h1", 2, 3, 0),
                                                ("zb-v", 4, 4, 1), ("dualpipe-v", 4, 4, 2)])
def test_partly_split_schedules_train_equal_to_plain_training(kind: str, schedule: str, cells: int,
                                                              m: int, n: int) -> None:
    build, loss_fn = MODELS[kind]
    batches = [data(kind, seed=5 + step) for step in range(2)]
    for mode in ("never", "except_last"):
        assert_same_training(build(), None, None, loss_fn, partitions=cells, micro_batches=m,
                             checkpoint=mode, batches=batches, optimizer=sgd_momentum, atol=1e-5,
                             schedule=schedule, split_backwards=n, cost="params")


def test_the_split_forward_runs_only_where_the_backward_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole backward must not pay for the split: its forward runs plain (no deferred layers)."""
    recorded: Counter[tuple[int, int]] = Counter()
    real_run = stage_module.StageExecutor._run

    def spy(self: Any, x: Any, m: int, recompute: bool = False) -> Any:
        before = len(self.deferred)
        out = real_run(self, x, m, recompute)
        if len(self.deferred) > before:
            recorded[(self.stage, m)] += 1
        return out
    monkeypatch.setattr(stage_module.StageExecutor, "_run", spy)
    build, loss_fn = MODELS["mlp"]
    x, y = data("mlp")
    pipe = GPipe(build(), partitions=2, micro_batches=4, checkpoint="never", schedule="zb-h1",
                 split_backwards=1, loss_fn=loss_fn, cost="params",
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    pipe.record_timeline = True
    pipe.train_step(x, y)
    assert recorded == Counter({(1, 3): 1})     # stage 0's input takes no gradient: nothing to split
    kinds = Counter((e.kind, e.microbatch) for e in pipe.last_timeline.events
                    if e.kind in ("backward", "backward_input", "backward_weight"))
    assert kinds == Counter({("backward", 0): 2, ("backward", 1): 2, ("backward", 2): 2,
                             ("backward_input", 3): 2, ("backward_weight", 3): 2})


def test_a_compiled_pipeline_runs_a_zero_bubble_order_with_no_split() -> None:
    """compile= refuses the split (a compiled layer's backward is one node); with split_backwards=0
    the zero-bubble order has none, so compile is checked no further than that."""
    from gpipe_repro.engine.arguments import compile_options
    with pytest.raises(ValueError, match="split_backwards=0"):
        compile_options(True, make_schedule("zb-h1", 2, 4, "never"))
    assert compile_options(True, make_schedule("zb-h1", 2, 4, "never", split_backwards=0)) == {}


def test_auto_chooses_from_the_layers_timed_and_trains_equal_to_plain_training() -> None:
    build, loss_fn = MODELS["mlp"]
    x, y = data("mlp")
    pipe = assert_same_training(build(), x, y, loss_fn, partitions=2, micro_batches=4, checkpoint="never",
                                steps=2, optimizer=sgd_momentum, atol=1e-5, schedule="zb-h1",
                                split_backwards="auto", sample=x[:2])
    assert isinstance(pipe.split_backwards, int) and 0 <= pipe.split_backwards <= 4
    kinds = _kinds(pipe.make_schedule(), 1)
    assert sum(A.BACKWARD_INPUT in k for k in kinds.values()) == pipe.split_backwards


def test_auto_is_refused_without_timings_to_choose_from() -> None:
    build, loss_fn = MODELS["mlp"]
    x, _ = data("mlp")
    for kwargs, message in [
            (dict(schedule="zb-h1"), r"split_backwards='auto' chooses the count from the layers timed on "
                                     r"a sample: give sample="),
            (dict(schedule="zb-h1", sample=x[:2], cost="params"), r"cost='params' asks for another cut"),
            (dict(schedule="1f1b", sample=x[:2]), "schedule='1f1b' runs whole backwards")]:
        with pytest.raises(ValueError, match=message):
            GPipe(build(), partitions=2, micro_batches=4, loss_fn=loss_fn, split_backwards="auto", **kwargs)


@pytest.mark.parametrize("split_extra,expected", [(0.0, None), (0.2, 1), (0.8, 1), (1.0, 0)])
def test_auto_splits_every_backward_when_the_split_is_free_and_only_the_last_when_it_is_dear(
        split_extra: float, expected: int | None) -> None:
    """Unit layers (F = 1, B = 2), K=2, M=8: a free split (I + W = B) keeps the paper's schedule,
    shorter than any with fewer splits; one costing 1.2x to 1.8x a backward is kept to the last
    micro-batch, whose W fills the cool-down; at 2x even that costs what it fills, and none splits."""
    from gpipe_repro.engine.split_count import choose_split_count
    timed = [(1.0, 2.0, 2.0 * (1.0 + split_extra))] * 8
    cut, n = choose_split_count("zb-h1", 8, "never", False, timed, [[4, 4]])
    assert cut == [4, 4] and n == (8 if expected is None else expected)


def test_fewest_splits_breaks_a_tie_toward_fewer_splits() -> None:
    from gpipe_repro.engine.split_count import fewest_splits
    steps = {(("a",), 0): 1.0005, (("a",), 3): 1.0, (("b",), 1): 1.2}
    assert fewest_splits(steps) == (("a",), 0)
    assert fewest_splits(steps, tie=0.0) == (("a",), 3)


def test_auto_checks_a_given_cut_before_timing_and_takes_any_integer_count() -> None:
    import numpy as np
    build, loss_fn = MODELS["mlp"]
    x, _ = data("mlp")
    for balance, message in [([2.0, 3.0], "balance"), ([1, 1, 1], "balance has 3 cells but partitions=2")]:
        with pytest.raises((ValueError, TypeError), match=message):
            GPipe(build(), partitions=2, micro_batches=4, loss_fn=loss_fn, schedule="zb-h1",
                  split_backwards="auto", sample=x[:2], balance=balance)
    with pytest.raises(ValueError, match=r"split_backwards='auto' is for the zero-bubble schedules"):
        GPipe(build(), partitions=2, micro_batches=4, loss_fn=loss_fn, schedule="1f1b",
              split_backwards="auto", sample=x[:2])
    # a given cut makes the cost irrelevant: "auto" times the layers for the count alone
    layers = build()
    half = len(layers) // 2
    pipe = GPipe(layers, partitions=2, micro_batches=4, loss_fn=loss_fn, schedule="zb-h1", cost="params",
                 split_backwards="auto", sample=x[:2], balance=[half, len(layers) - half])
    assert pipe.balance == [half, len(layers) - half] and isinstance(pipe.split_backwards, int)
    numpy_count = GPipe(build(), partitions=2, micro_batches=4, loss_fn=loss_fn, cost="params",
                        schedule="zb-h1", split_backwards=np.int64(2))
    assert numpy_count.split_backwards == 2 and type(numpy_count.split_backwards) is int


def test_a_count_above_a_changed_micro_batch_count_names_what_to_change() -> None:
    build, loss_fn = MODELS["mlp"]
    x, y = data("mlp")
    pipe = GPipe(build(), partitions=2, micro_batches=4, loss_fn=loss_fn, cost="params", schedule="zb-h1",
                 split_backwards=3, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    pipe.micro_batches = 2
    with pytest.raises(ValueError, match=r"split_backwards=3 \(pipe.split_backwards.*"
                                         r"set pipe.split_backwards to at most 2"):
        pipe.train_step(x, y)


def _auto_with_this_ranks_balance() -> list[int]:
    """Runs in each of 2 stage processes: a different cut per rank beside "auto"."""
    import os
    build, loss_fn = MODELS["mlp"]
    x, _ = data("mlp")
    layers = build()
    cut = [2, len(layers) - 2] if os.environ["RANK"] == "0" else [3, len(layers) - 3]
    GPipe(layers, partitions=2, micro_batches=4, loss_fn=loss_fn, schedule="zb-h1", split_backwards="auto",
          sample=x[:2], balance=cut, runtime="distributed")
    return cut


def test_silent_auto_replaced_a_cut_that_differs_between_ranks_by_rank_0s() -> None:
    from gpipe_repro.distributed import launch_local
    from gpipe_repro.distributed.launcher import JobFailed
    with pytest.raises(JobFailed, match="the ranks were given different balance"):
        launch_local(_auto_with_this_ranks_balance, 2, timeout=30)


def test_a_compiled_pipeline_refuses_a_split_set_after_construction() -> None:
    """compile= is checked against the schedule at construction; a count set afterwards that splits
    backwards (inside which a compiled layer cannot defer its weights) is refused when it is used."""
    build, loss_fn = MODELS["mlp"]
    pipe = GPipe(build(), partitions=2, micro_batches=4, loss_fn=loss_fn, cost="params", schedule="zb-h1",
                 split_backwards=0, compile={"backend": "eager"})
    assert not pipe.make_schedule().splits_backward
    pipe.split_backwards = 2
    with pytest.raises(ValueError, match="compile=.*split_backwards=0"):
        pipe.make_schedule()
