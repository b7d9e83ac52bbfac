"""The figure plumbing shared by every results figure (report/plots.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpipe_repro.report.plots import log2_axis, pyplot, save_figure


def test_log2_axis_and_save_figure(tmp_path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2, 4, 8], [1, 2, 3, 4])
    log2_axis(ax, [1, 2, 4, 8])
    assert ax.get_xscale() == "log" and [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8"]
    with pytest.raises(ValueError, match="axis must be 'x' or 'y'"):
        log2_axis(ax, [1], axis="z")
    path = save_figure(fig, tmp_path / "new" / "f.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"          # the folder was created
    assert fig.number not in plt.get_fignums()                      # and the figure closed
