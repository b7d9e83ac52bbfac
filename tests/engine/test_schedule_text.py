"""Schedules as text: round trip, golden files of the generated schedules, the broken-schedule zoo.

Regenerate the golden files after an intended change of a generator:
    GPIPE_REPRO_REGOLD=1 .venv/bin/python -m pytest -q tests/engine/test_schedule_text.py
and review the diff like any other change.
"""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from gpipe_repro.engine.schedule import Schedule, ScheduleError, gpipe_schedule, make_schedule
from tests.schedules import BROKEN

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
# file stem -> the schedule it holds
GOLDEN_CASES = {
    "gpipe_k3_m4_never": lambda: make_schedule("gpipe", 3, 4, "never"),
    "gpipe_k3_m4_always": lambda: make_schedule("gpipe", 3, 4, "always"),
    "gpipe_k3_m4_except_last": lambda: make_schedule("gpipe", 3, 4, "except_last"),
    "gpipe_k3_m4_always_ahead": lambda: make_schedule("gpipe", 3, 4, "always", True),
    "1f1b_k4_m6_never": lambda: make_schedule("1f1b", 4, 6, "never"),
    "1f1b_k2_m4_except_last": lambda: make_schedule("1f1b", 2, 4, "except_last"),
    "forward_k3_m4": lambda: gpipe_schedule(3, 4, training=False),
    "zb-h1_k4_m6_never": lambda: make_schedule("zb-h1", 4, 6, "never"),
    "zb-h1_k2_m4_except_last_ahead": lambda: make_schedule("zb-h1", 2, 4, "except_last", True),
    "interleaved_k2_v2_m4_never": lambda: make_schedule("interleaved", 4, 4, "never"),
    "interleaved_k2_v2_m4_except_last_ahead": lambda: make_schedule("interleaved", 4, 4, "except_last", True),
    "zb-v_k2_m4_never": lambda: make_schedule("zb-v", 4, 4, "never"),
    "zb-v_k3_m6_always_ahead": lambda: make_schedule("zb-v", 6, 6, "always", True),
    "dualpipe-v_k2_m4_never": lambda: make_schedule("dualpipe-v", 4, 4, "never"),
    "dualpipe-v_k3_m7_except_last_ahead": lambda: make_schedule("dualpipe-v", 6, 7, "except_last", True),
}


@pytest.mark.parametrize("stem", sorted(GOLDEN_CASES))
def test_generated_schedule_matches_its_golden_file(stem: str) -> None:
    text = GOLDEN_CASES[stem]().to_text() + "\n"
    path = GOLDEN / f"{stem}.txt"
    if os.environ.get("GPIPE_REPRO_REGOLD"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run with GPIPE_REPRO_REGOLD=1 and review it"
    assert text == path.read_text(), (f"{stem} changed; if intended, regenerate with "
                                      "GPIPE_REPRO_REGOLD=1 and review the diff")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
@pytest.mark.parametrize("k,m", [(1, 1), (2, 3), (4, 8)])
@pytest.mark.parametrize("ahead", [False, True])
def test_text_round_trips(name: str, mode: str, k: int, m: int, ahead: bool) -> None:
    s = make_schedule(name, k, m, mode, ahead)
    assert Schedule.from_text(s.to_text()) == s
    s.check_link_order()   # every generated schedule suits in-order backends (NCCL)


def test_golden_files_parse_and_validate() -> None:
    for path in GOLDEN.glob("*.txt"):
        Schedule.from_text(path.read_text()).validate()


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_zoo_of_broken_schedules_is_rejected_with_the_action_marked(name: str) -> None:
    text, message, check = BROKEN[name]
    schedule = Schedule.from_text(textwrap.dedent(text))
    with pytest.raises(ScheduleError, match=message) as info:
        schedule.validate() if check == "validate" else schedule.check_link_order()
    shown = str(info.value)
    assert "schedule broken" in shown and "<-- ERROR" in shown, shown
    assert ">>" in shown or "is missing" in shown, shown   # a missing action has nothing to bracket


@pytest.mark.parametrize("text,message", [
    ("stage 0: F0 B0 U", "must start with 'schedule"),
    ("schedule x stages=two micro_batches=1", "cannot read"),
    ("schedule x stages=1 micro_batches=1\nstage 0: F0 Q0 U", "unknown action 'Q0'"),
    ("schedule x stages=2 micro_batches=1\nstage 0: F0 B0 U", r"stages=2 but the text lists stages \[0\]"),
    ("schedule x stages=1 micro_batches=1\nstage 0: F0\nstage 0: B0", "listed twice"),
    ("schedule x stages=1 micro_batches=1\nrow 0: F0", "expected 'stage N: actions"),
    # the same reader serves the process form: the same errors, in its own words
    ("schedule x stages=2 micro_batches=1 processes=1\nprocess 0: F0@0\nprocess 0: F0@1",
     "line 3: process 0 is listed twice"),
    ("schedule x stages=2 micro_batches=1 processes=1\nstage 0: F0@0",
     r"line 2: expected 'process N: actions@stage\.\.\.'"),
    ("schedule x stages=2 micro_batches=1 processes=1\nprocess 0: F0@0 >>Q1@1<<", "unknown action 'Q1'"),
])
def test_unreadable_text_names_the_problem(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_text(text)
