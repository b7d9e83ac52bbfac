"""The planner's search choosing the schedule too (memory/autoplan.py), at toy scale."""
from __future__ import annotations

import pytest

from gpipe_repro.memory.autoplan import evaluate, not_applicable, schedule_verdict, search
from gpipe_repro.memory.planner import MemoryPlanner
from gpipe_repro.memory.workloads import workload
from gpipe_repro.sim.links import PRESETS


def _tiny() -> MemoryPlanner:
    work = workload("transformer-lm", 8, L=2, d_model=32, d_ff=64, num_heads=2, vocab_size=100,
                    seq_len=16)
    return MemoryPlanner(*work.planner_inputs())         # 4 layers


def test_search_chooses_the_schedule_and_says_why_the_others_lost() -> None:
    planner = _tiny()
    names = ["gpipe", "1f1b", "interleaved", "zb-h1"]
    cands = search(planner, 2, 1e12, PRESETS["ideal"], 1e12, micro_batches=[4], checkpoints=("never",),
                   schedules=names)
    # K=1 runs gpipe only; K=2 every schedule (4 layers = 2K cells for interleaved).
    assert sorted((c.partitions, c.schedule) for c in cands) == [
        (1, "gpipe"), (2, "1f1b"), (2, "gpipe"), (2, "interleaved"), (2, "zb-h1")]
    by = {c.schedule: c for c in cands if c.partitions == 2}
    assert all(c.fits for c in cands) and cands[0].throughput == max(c.throughput for c in cands)
    # Interleaved: 2K cells, a device's peak its two cells' walked together (cell c on device c mod K)
    inter = by["interleaved"]
    assert len(inter.balance) == 4 and inter.plan is not None
    assert inter.max_peak == max(d.peak for d in inter.plan.devices) == inter.plan.max_peak
    # With FLOP costs and a free link, ZB-H1 beats fill-drain at equal K, M (Qi et al., ICLR 2024).
    assert by["zb-h1"].throughput > by["gpipe"].throughput
    lines = schedule_verdict(cands, names, 1e12)
    assert len(lines) == 4 and sum("chosen" in line for line in lines) == 1
    assert any(line.startswith(f"{cands[0].schedule}: chosen") for line in lines)
    assert all("slower" in line for line in lines if "chosen" not in line)


def test_what_does_not_apply_is_said_and_skipped() -> None:
    planner = _tiny()
    assert "M=3 is not a multiple of 2" in not_applicable("interleaved", 2, 3, 4)   # the schedule's words
    assert "M >= 2K" in not_applicable("dualpipe-v", 2, 3, 8)
    assert "only 4 layers" in not_applicable("interleaved", 4, 4, 4)
    assert "gpipe's" in not_applicable("zb-h1", 1, 4, 4)
    assert not_applicable("1f1b", 2, 3, 4) == ""
    cands = search(planner, 2, 1e12, PRESETS["ideal"], 1e12, micro_batches=[3], checkpoints=("never",),
                   schedules=["gpipe", "interleaved"])
    assert {c.schedule for c in cands} == {"gpipe"}
    assert schedule_verdict(cands, ["gpipe", "interleaved"], 1e12)[1] == (
        "interleaved: applies to none of the K, M tried")
    tight = evaluate(planner, 2, 4, "never", 1.0, PRESETS["ideal"], 1e12, "interleaved")
    assert not tight.fits and tight.note
    with pytest.raises(ValueError, match="unknown schedule.*choose from"):
        search(planner, 2, 1e12, PRESETS["ideal"], 1e12, schedules=["fifo"])


def test_a_budget_below_what_stays_on_a_device_is_said_in_gib() -> None:
    """`plan-replicas --memory 0.01` read "the cap per device is -1.833e+09": the search lowered its
    memory cap below zero and the partitioner quoted it in raw bytes."""
    cand = evaluate(_tiny(), 2, 4, "never", 1.0, PRESETS["ideal"], 1e12)
    assert not cand.fits and cand.note.startswith("does not fit: the largest device needs")
    assert "cap per device is -" not in cand.note


def test_a_plan_of_several_cells_per_device_peaks_per_device() -> None:
    """MemoryPlan.max_peak and fits() read the devices: interleaved's and zb-v's cells walked
    together per device (cell c on device c mod K; the V's cells 0 and 3 on device 0), at most the
    sum of their peaks."""
    planner = _tiny()
    for schedule, devices in (("interleaved", [[0, 2], [1, 3]]), ("zb-v", [[0, 3], [1, 2]]),
                              ("1f1b", [[0], [1], [2], [3]])):
        plan = planner.plan(4, 4, "never", schedule=schedule)
        cells = [s.peak for s in plan.stages]
        summed = [sum(cells[c] for c in d) for d in devices]
        if schedule == "1f1b":
            assert plan.device_peaks == summed and not plan.devices
        else:
            assert len(plan.device_peaks) == 2
            assert all(max(cells[c] for c in d) <= p <= s
                       for d, p, s in zip(devices, plan.device_peaks, summed))
        assert plan.max_peak == max(plan.device_peaks)
        assert plan.fits(plan.max_peak) and not plan.fits(plan.max_peak - 1)
        assert plan.to_dict()["device_peaks_bytes"] == plan.device_peaks


@pytest.mark.parametrize("schedule,split", [("1f1b", None), ("zb-h1", 1), ("interleaved", None)])
def test_silent_advice_planned_gpipe_for_a_plan_of_another_schedule(schedule: str, split: int | None) -> None:
    """`fit`'s and `plan`'s advice planned each lever with gpipe whatever the configuration's schedule
    (and every backward split): its peaks were another schedule's. Each lever is planned with the
    plan's own schedule and split count."""
    from gpipe_repro.memory.advice import what_would_fit
    from gpipe_repro.memory.planner import gib

    planner = _tiny()
    plan = planner.plan(2, 2, "never", schedule=schedule, split_backwards=split)
    expected = planner.plan(2, 2, "except_last", schedule=schedule, split_backwards=split)
    gpipe = planner.plan(2, 2, "except_last")
    assert gib(expected.max_peak) != gib(gpipe.max_peak)     # the schedule matters here
    # except_last fits exactly: the advice names it (the least re-materialization that fits)
    lines = what_would_fit(planner, plan, budget=expected.max_peak)
    assert lines[0].startswith("re-materialization (--checkpoint except_last)")
    assert f"{gib(expected.max_peak)} GiB" in lines[0]


def test_advice_names_the_re_materialization_that_fits_and_combines_it_with_more_micro_batches() -> None:
    """`fit --checkpoint never --schedule 1f1b` suggested only except_last, which under 1F1B keeps
    about what never keeps ("still too much"), not always, which fits; and said more micro-batches
    did not fit where more micro-batches with re-materialization did."""
    from gpipe_repro.memory.advice import what_would_fit

    planner = _tiny()
    plan = planner.plan(2, 2, "never", schedule="1f1b")
    peaks = {c: planner.plan(2, 2, c, schedule="1f1b").max_peak for c in ("except_last", "always")}
    assert peaks["always"] < peaks["except_last"] <= plan.max_peak
    budget = (peaks["always"] + peaks["except_last"]) / 2      # only always fits at M=2
    lines = what_would_fit(planner, plan, budget=budget)
    assert lines[0].startswith("re-materialization (--checkpoint always)") and lines[0].endswith("fits")
    four = {c: planner.plan(2, 4, c, schedule="1f1b").max_peak for c in ("never", "always")}
    budget = (four["never"] + four["always"]) / 2       # M=4 fits with always only, M=2 not at all
    assert peaks["always"] > budget
    lines = what_would_fit(planner, plan, budget=budget)
    assert lines[0].startswith("re-materialization (--checkpoint always)") and lines[0].endswith("too much")
    assert "more micro-batches: M=4 with --checkpoint always fits" in lines[1]
