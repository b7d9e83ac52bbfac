"""Long runs show progress off a terminal too: a rich spinner or bar prints nothing into a log, so a
module that draws one must also have the plain-line path (`gpipe_repro.report.measurement.Progress`
or an isatty check)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "gpipe_repro").rglob("*.py"), *(ROOT / "experiments").rglob("*.py")])


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_rich_progress_has_a_plain_line_off_a_terminal(path: Path) -> None:
    text = path.read_text()
    assert not re.search(r"\.status\(\s*[\"']", text), (
        f"{path.relative_to(ROOT)}: a rich Console.status spinner is silent off a terminal; use "
        "gpipe_repro.report.measurement.Progress (a plain line at least every 30 s)")
    if "rich.progress" in text:
        assert re.search(r"isatty|is_terminal", text), (
            f"{path.relative_to(ROOT)}: draws a rich progress bar without a plain-line path for logs")


def test_silent_validate_sim_printed_nothing_for_minutes_into_a_log() -> None:
    """`make validate-sim` under `make results` wrote nothing for 8 minutes: its progress went to a
    rich spinner, which a log does not show."""
    text = (ROOT / "gpipe_repro" / "repro" / "validate_simulator.py").read_text()
    assert "Progress(COMMAND)" in text and "console.status" not in text
