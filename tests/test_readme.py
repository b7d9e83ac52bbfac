"""Every code block of README.md runs as written.

Each ```python block is written to a file and run as a script in a fresh interpreter (so a block that
starts stage processes with ``if __name__ == "__main__":`` runs as a user's script would). Shell
blocks get cheap checks only: every `make X` names a target of the Makefile, and every
`gpipe-repro CMD ...` names a command whose `--help` exits with 0.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# this checkout's gpipe_repro, whatever the venv's editable install points at
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README) if lang == language]


PYTHON_BLOCKS = _blocks("python")
SHELL_LINES = [line.split("#")[0].strip() for body in _blocks("") + _blocks("bash") + _blocks("sh")
               for line in body.splitlines()]
SHELL_LINES = [line for line in SHELL_LINES if line]


def _first_line(block: str) -> str:
    return next((line for line in block.splitlines() if line and not line.startswith(("import", "from"))),
                block.splitlines()[0])


def test_readme_has_blocks() -> None:
    assert len(PYTHON_BLOCKS) >= 3 and SHELL_LINES


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"python-{i}" for i in range(len(PYTHON_BLOCKS))])
def test_python_block_runs(block: str, tmp_path: Path) -> None:
    script = tmp_path / "readme_block.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert done.returncode == 0, (f"README block starting {_first_line(block)!r} failed:\n"
                                  f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def _make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w.-]+):(?!=)", makefile, re.MULTILINE))


def test_make_targets_exist() -> None:
    named = {word for line in SHELL_LINES if line.startswith("make ")
             for word in line.split()[1:2] if "=" not in word}
    assert named, "the README names no make target"
    missing = named - _make_targets()
    assert not missing, f"the README names make targets the Makefile lacks: {sorted(missing)}"


GPIPE_COMMANDS = sorted({tuple(w for w in line.split()[1:3] if not w.startswith("-"))
                         for line in SHELL_LINES if line.startswith("gpipe-repro ")})


@pytest.mark.parametrize("command", GPIPE_COMMANDS, ids=[" ".join(c) for c in GPIPE_COMMANDS])
def test_gpipe_repro_command_exists(command: tuple[str, ...]) -> None:
    """`gpipe-repro CMD [SUB] --help` exits with 0 (SUB is kept only where CMD is a group)."""
    from typer.testing import CliRunner

    from gpipe_repro.cli import app

    done = CliRunner().invoke(app, [*command[:1], "--help"])
    assert done.exit_code == 0, f"gpipe-repro {command[0]} --help: {done.output[-2000:]}"
    if len(command) > 1 and "Commands" in done.output:
        done = CliRunner().invoke(app, [*command, "--help"])
        assert done.exit_code == 0, f"gpipe-repro {' '.join(command)} --help: {done.output[-2000:]}"
