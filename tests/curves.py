"""Training runs whose picture a test never looks at: curves.png is not rendered.

`train()` ends by drawing the run's curves with matplotlib (gpipe_repro/train/curves.py), about 0.4 s
of a toy run of well under a second otherwise: most of what a test of resuming, K-invariance or
offline data would spend. Those tests use :func:`curves_not_drawn`: the run's metrics rows still go
through the curves' own data helpers (every series the figure plots, smoothed as it smooths them) and
the file is still written where the run expects it, only matplotlib is skipped. The drawing itself
stays in the tests that check or need it: the AmoebaNet run's outputs (tests/train/test_loop.py), a
run resumed after a crash (tests/train/test_resume.py), a translation run with BLEU beside NLL
(tests/train/test_translation.py), and every distributed run's rank 0 (a process of its own).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpipe_repro.train import curves


@contextlib.contextmanager
def curves_not_drawn() -> Iterator[list[Path]]:
    """Within the block, a run's curves.png is an empty file; yields the paths that were written."""
    written: list[Path] = []

    def undrawn(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str) -> Path:
        evals = sorted({k for r in rows for k in r if k.startswith("eval/") and not k.endswith("_s")})
        for key in ["train/loss", "train/lr", "train/samples_per_s", *evals]:   # what the figure plots
            curves.smoothed(curves.series(rows, key)[1])
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        written.append(path)
        return path

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(curves, "plot_run_curves", undrawn)
        yield written
