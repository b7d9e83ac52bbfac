"""Receives posted ahead on gloo: a window per channel, free of deadlock, and memory that does not
grow with M where the schedule's does not."""
from __future__ import annotations

import gc
import json
import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro.distributed import launch_local
from gpipe_repro.engine.schedule import Action, ActionKind, make_schedule
from gpipe_repro.engine.schedule.receive_window import completes, fill_drain, receive_window

CASES = [("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4), ("interleaved", 4), ("interleaved", 8),
         ("zb-h1", 2), ("zb-h1", 4), ("zb-v", 4), ("zb-v", 8), ("dualpipe-v", 4), ("dualpipe-v", 8)]


@pytest.mark.parametrize(("name", "cells"), CASES)
def test_every_schedule_completes_within_a_window_that_does_not_grow_with_m(name: str, cells: int) -> None:
    checked = 0
    for m in (1, 2, 3, 4, 8, 16):
        for checkpoint in ("never", "always", "except_last"):
            try:
                schedule = make_schedule(name, cells, m, checkpoint)
            except ValueError:
                continue                            # M this schedule does not take
            programs = schedule.programs()
            window = receive_window(programs, m)
            assert completes(programs, window) and completes(programs, m)
            if name == "gpipe":      # fill-drain: every micro-batch held at once anyway, all posted
                assert fill_drain(programs) and window == m
            else:
                assert not fill_drain(programs) or m == 1
                assert window <= min(m, max(2, len(programs))), (name, cells, m, checkpoint, window)
            checked += 1
    assert checked >= 6


def _two_way(n: int) -> list[list[Action]]:
    """Two processes that each send `n` values to the other, with compute between, before receiving
    any: a send older than the previous compute action is waited for before the next, so with fewer
    than n - 1 receives posted ahead each waits on the other."""
    def program(stage: int, send: ActionKind, recv: ActionKind) -> list[Action]:
        out: list[Action] = []
        for m in range(n):
            out += [Action(ActionKind.FORWARD, stage, m), Action(send, stage, m)]
        return out + [Action(ActionKind.FORWARD, stage, n)] + [Action(recv, stage, m) for m in range(n)]
    return [program(0, ActionKind.SEND_ACT, ActionKind.RECV_GRAD),
            program(1, ActionKind.SEND_GRAD, ActionKind.RECV_ACT)]


def test_the_check_finds_a_deadlock_and_the_window_grows_past_it() -> None:
    programs = _two_way(4)
    assert not completes(programs, 2)
    assert completes(programs, 3)
    assert receive_window(programs, 4) == 4          # 2 deadlocks; doubled to 4 (M)


# -- memory: independent of the transport, from torch's own allocator counter ----------------------
WIDTH, ROWS, BALANCE = 256, 40, [4, 5]


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())],
                         nn.Linear(WIDTH, 10))


def _batch(micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(ROWS * micro_batches, WIDTH, generator=g),
            torch.randint(0, 10, (ROWS * micro_batches,), generator=g))


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def _peak_during_a_step(micro_batches: int, schedule: str = "1f1b", first: bool = False) -> int:
    """The most bytes this rank's allocator held during one training step beyond what it held before
    it (torch.profiler's CPU 'Total Allocated' counter), after warm-up steps, the gradients dropped
    (so that they count as the step's)."""
    from torch.profiler import ProfilerActivity, profile

    from gpipe_repro import GPipe
    layers = _layers()
    pipe = GPipe(layers, partitions=2, micro_batches=micro_batches, checkpoint="never", schedule=schedule,
                 balance=BALANCE, runtime="distributed", loss_fn=nn.CrossEntropyLoss(), optimizer=_sgd)
    x, y = _batch(micro_batches)
    pipe.train_step(x, y)
    pipe.train_step(x, y)            # receives posted ahead from the second step with these shapes
    if first:                        # one more row per micro-batch: new shapes, their first step
        x, y = torch.cat([x, x[:micro_batches]]), torch.cat([y, y[:micro_batches]])
    for p in layers.parameters():
        p.grad = None
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pipe.train_step(x, y)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    return max(totals)


def test_silent_1f1b_on_gloo_held_a_received_buffer_for_every_micro_batch() -> None:
    """1F1B keeps at most K micro-batches in flight, so at a fixed micro-batch size its peak does not
    depend on M. On gloo every receive of the step was posted at its start: the last stage held M
    activations' buffers, stage 0 M gradients', 12 micro-batches' more at M=16 than at M=4 (the
    memory plan, which counts K, said it fitted)."""
    peaks = {m: launch_local(_peak_during_a_step, 2, m, threads=1) for m in (4, 16)}
    boundary = ROWS * WIDTH * 4                   # one micro-batch's activation (or its gradient)
    for rank in range(2):
        grown = peaks[16][rank] - peaks[4][rank]
        assert grown < boundary, (f"rank {rank}: the peak grew by {grown / boundary:.1f} micro-batches' "
                                  f"boundary values from M=4 to M=16 ({peaks})")


@pytest.mark.parametrize(("schedule", "micro_batches"), [("1f1b", 4), ("1f1b", 16), ("gpipe", 8)])
def test_silent_the_plan_of_a_gloo_run_left_out_its_receives_and_sends_in_flight(
        schedule: str, micro_batches: int) -> None:
    """MemoryPlanner.plan(transport="gloo") against the allocator's own count on each rank: the step's
    peak beyond the parameters, the optimizer's state, the buffers and the caller's data. The plan
    of one process (receives at their action, a sent value let go at once) was short of a gloo run
    by the receives posted ahead and the sends in flight (by M micro-batches' before the window)."""
    from gpipe_repro.memory import MemoryPlanner
    x, y = _batch(micro_batches)
    planner = MemoryPlanner(_layers(), x, y, nn.CrossEntropyLoss(), optimizer=_sgd)
    plan = planner.plan(2, micro_batches, "never", balance=BALANCE, schedule=schedule, transport="gloo")
    measured = launch_local(_peak_during_a_step, 2, micro_batches, schedule, threads=1)
    for stage, got in zip(plan.stages, measured):
        parts = stage.parts
        planned = stage.peak - sum(parts.get(k, 0) for k in ("params", "optimizer", "buffers", "data"))
        assert abs(planned - got) <= 0.01 * got, (stage.stage, planned, got)


def test_the_first_step_of_new_shapes_lets_its_sends_go_during_the_step() -> None:
    """The first step of an input signature receives each value at its action (the boundary specs
    travel first); on gloo it kept everything it sent until the step's end, M micro-batches' worth. A
    schedule whose waits cannot deadlock that way (1F1B here) now waits for them during the step, as
    later steps do."""
    peaks = {m: launch_local(_peak_during_a_step, 2, m, "1f1b", True, threads=1) for m in (4, 16)}
    boundary = (ROWS + 1) * WIDTH * 4
    for rank in range(2):
        grown = peaks[16][rank] - peaks[4][rank]
        assert grown < 2 * boundary, (f"rank {rank}: the first step's peak grew by "
                                      f"{grown / boundary:.1f} micro-batches' boundary values ({peaks})")


def test_inference_works_out_the_window_once_for_equal_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference builds a new schedule per call: the runtime's cache of the window, keyed by the
    schedule object, worked the window out again on every call. Keyed by the programs, an equal
    schedule is looked up; another one is worked out."""
    from types import SimpleNamespace

    from gpipe_repro.distributed import runtime

    calls: list[int] = []
    real = runtime.receive_window

    def counted(programs: Any, m: int) -> int:
        calls.append(m)
        return real(programs, m)
    monkeypatch.setattr(runtime, "receive_window", counted)
    host = SimpleNamespace(_windows={})
    for _ in range(3):
        got = runtime.DistributedRuntime._receive_window(host, make_schedule("1f1b", 2, 4, "never"))  # type: ignore[arg-type]
    assert got == (2, True) and calls == [4]
    runtime.DistributedRuntime._receive_window(host, make_schedule("1f1b", 2, 8, "never"))  # type: ignore[arg-type]
    assert calls == [4, 8]
