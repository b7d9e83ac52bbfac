"""The Gantt chart draws every compute action a schedule runs."""
from __future__ import annotations

from pathlib import Path

from gpipe_repro.engine.interpreter import run_dataflow
from gpipe_repro.engine.schedule import COMPUTE, make_schedule
from gpipe_repro.engine.timeline import Event, Timeline
from gpipe_repro.report.gantt import _bars, render_gantt


def test_silent_gantt_dropped_the_split_backwards_halves(tmp_path: Path) -> None:
    """A zero-bubble timeline's I and W were left out of the chart (gaps where they ran)."""
    schedule = make_schedule("zb-h1", 2, 4, "never", split_backwards=2)
    events = [Event(e.action.stage, e.action.kind.value, e.action.microbatch, e.start, e.end)
              for e in run_dataflow(schedule, lambda a: 1.0 if a.kind in COMPUTE else 0.0)]
    timeline = Timeline(2, events)
    drawn = {(stage, text) for stage, _, _, _, text in _bars(timeline)}
    assert {(1, "I3"), (1, "W3"), (1, "I2"), (1, "W2"), (1, "B0"), (0, "W3")} <= drawn
    computed = [e for e in events if e.kind in {k.value for k in COMPUTE}]
    assert len([b for b in _bars(timeline) if b[4] and b[1] != "agree"]) == len(computed)
    assert render_gantt(timeline, tmp_path / "zb.png").exists()
