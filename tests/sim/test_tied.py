"""The tied parameter's all-reduce on the simulated step, against hand-computed values."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_repro.engine.schedule import make_schedule
from gpipe_repro.sim.links import LinkModel, get_link
from gpipe_repro.sim.simulator import PipelineCosts, Simulation, simulate
from gpipe_repro.sim.tied import TIED_EXPOSED, cell_ties, layer_ties, tie_allreduce_time, with_tied_allreduce

SLOW = LinkModel("slow", 0.25, 1.0)   # 0.25 s per message, 1 byte/s


def _sim(schedule: str, k: int, m: int) -> Simulation:
    # forward 1 s, backward 2 s per micro-batch, free links; gpipe K=2 M=2: stage 1 reaches AGREE at
    # 7 s, stage 0 at 9 s
    f, b = [[1.0] * m] * k, [[2.0] * m] * k
    costs = PipelineCosts(f, f, f, b, [0.0] * k, [[0.0] * m] * k, [[0.0] * m] * k)
    return simulate(make_schedule(schedule, k, m, "never", False), costs, get_link("ideal"), 8)


def test_ring_of_two_costs_two_messages_and_the_bytes_once() -> None:
    # ring: 2 (p - 1) alpha + 2 (p - 1) / p n / B
    assert tie_allreduce_time(3.0, 2, SLOW) == pytest.approx(2 * 0.25 + 3.0)
    assert tie_allreduce_time(3.0, 1, SLOW) == 0.0


def test_tie_between_first_and_last_stage_delays_the_step_by_its_all_reduce() -> None:
    sim = _sim("gpipe", 2, 2)
    tied = with_tied_allreduce(sim, make_schedule("gpipe", 2, 2, "never"), [(3.0, [0, 1])], SLOW)
    assert tied.step_time == pytest.approx(sim.step_time + 3.5)
    assert tied.breakdown[TIED_EXPOSED] == pytest.approx(3.5 / tied.step_time)
    assert sum(tied.breakdown.values()) == pytest.approx(sum(sim.breakdown.values()))


def test_ties_run_one_after_another_and_one_process_costs_nothing() -> None:
    sim = _sim("gpipe", 2, 2)
    two = with_tied_allreduce(sim, make_schedule("gpipe", 2, 2, "never"),
                              [(3.0, [0, 1]), (1.0, [0, 1])], SLOW)
    assert two.step_time == pytest.approx(sim.step_time + 3.5 + 1.5)
    # zb-v: cells 0 and 3 of 4 are both on process 0; no collective
    zbv = _sim("zb-v", 4, 2)
    schedule = make_schedule("zb-v", 4, 2, "never")
    assert schedule.process_of()[0] == schedule.process_of()[3]
    assert with_tied_allreduce(zbv, schedule, [(3.0, [0, 3])], SLOW).step_time == zbv.step_time


def test_a_tie_whose_processes_arrive_early_hides_behind_the_drain() -> None:
    # gpipe K=3 M=2: stage 0 reaches AGREE last; a tie of stages 1 and 2 starts earlier
    sim = _sim("gpipe", 3, 2)
    schedule = make_schedule("gpipe", 3, 2, "never")
    agree = {e.stage: e.start for e in sim.timeline.events if e.kind == "agree"}
    slack = agree[0] - max(agree[1], agree[2])
    assert slack > 0
    hidden = with_tied_allreduce(sim, schedule, [(slack - 0.5 - 0.25, [1, 2])], SLOW)
    assert hidden.step_time == sim.step_time
    out = with_tied_allreduce(sim, schedule, [(slack - 0.5 + 1.0, [1, 2])], SLOW)
    assert out.step_time == pytest.approx(sim.step_time + 1.0)


def _tied_lm(vocab: int = 64, width: int = 16) -> list[nn.Module]:
    embed = nn.Embedding(vocab, width)
    head = nn.Linear(width, vocab, bias=False)
    head.weight = embed.weight
    return [embed, nn.Linear(width, width), nn.Linear(width, width), head]


def test_layer_ties_finds_the_tied_embedding_with_its_bytes_and_positions() -> None:
    layers = _tied_lm()
    assert layer_ties(layers) == [(64 * 16 * 4.0, [0, 3])]
    assert cell_ties(layer_ties(layers), [2, 2]) == [(64 * 16 * 4.0, [0, 1])]
    assert cell_ties(layer_ties(layers), [4]) == []            # one cell: nothing to all-reduce
    repeated = nn.Linear(4, 4)
    assert layer_ties([repeated, repeated]) == []              # a planner's run of one layer object


def test_the_planner_charges_the_tie_all_reduce_of_a_tied_model() -> None:
    from gpipe_repro.memory.autoplan import simulate_step
    from gpipe_repro.memory.planner import MemoryPlanner

    def step(layers: list[nn.Module]) -> float:
        planner = MemoryPlanner(layers, torch.zeros(8, 4, dtype=torch.long),
                                torch.zeros(8, 4, dtype=torch.long),
                                lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
        sched = make_schedule("gpipe", 2, 2, "never")
        return simulate_step(planner, sched, [2, 2], 2, 1e9, SLOW).step_time

    tied, untied = _tied_lm(), _tied_lm()
    untied[3].weight = nn.Parameter(untied[0].weight.detach().clone())
    assert step(tied) > step(untied)
