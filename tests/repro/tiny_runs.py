"""What the benchmarks' tiny-mode tests share: run a typer entry point and read what it printed."""
from __future__ import annotations

from typing import Any

import pytest


def tiny_page(app: Any, args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`app` run with `args` (exit code 0 asserted); everything it printed, the page included (the
    page goes to the process's stdout, beside what typer's runner captures)."""
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    print(result.output)
    return capsys.readouterr().out
