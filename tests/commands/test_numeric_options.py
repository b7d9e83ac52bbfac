"""Every number a command takes, given out of range, is a usage error before any work.

The sweep reads the options from the command line itself, so a command or option added later is in
it: each integer or float option of every command (and a Hugging Face model's size options, which
`fit` and `plan` take as extra arguments) given -1, and each float option given nan, must end in
exit code 2 with a message naming the option, no traceback, within seconds (before the model is
built, data loaded or processes started). The few options where a negative number means something
are listed with what it means."""
from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from gpipe_repro.cli import app

# What a command needs besides the option under test to reach its checks.
REQUIRED = {"fit": ["transformer-lm"], "plan": ["transformer-lm"], "plan-replicas": ["transformer-lm"],
            "throughput": ["--model", "hf:llama", "--k", "2", "--m", "2", "--no-validate"]}
# Options whose negative values are meaningful (none today): {("command", "--option"): "why"}.
NEGATIVE_ALLOWED: dict[tuple[str, str], str] = {}
# Extra size arguments a model family takes after `fit` / `plan` (not typer options).
EXTRA = [["fit", "hf:llama", "--layers"], ["fit", "hf:llama", "--hidden"], ["fit", "hf:llama", "--seq-len"],
         ["fit", "hf:llama", "--vocab"], ["plan", "hf:llama", "--kv-heads"],
         ["plan-replicas", "transformer-lm", "--L"], ["fit", "amoebanet-d", "--F"]]
SECONDS = 30


def _commands(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from _commands(sub, [*path, name])
    else:
        yield path, command


def _cases() -> list[Any]:
    cases = []
    for path, command in _commands(typer.main.get_command(app), []):
        for p in command.params:
            kind = p.bare_type() if hasattr(p, "bare_type") else None
            if type(p).__name__ != "TyperOption" or kind not in ("int", "float"):
                continue
            if (" ".join(path), p.opts[0]) in NEGATIVE_ALLOWED:
                continue
            for bad in ("-1", "nan") if kind == "float" else ("-1",):
                args = [*path, *REQUIRED.get(path[0], []), p.opts[0], bad]
                cases.append(pytest.param(args, p.opts[0], id=" ".join([*path, p.opts[0], bad])))
    cases += [pytest.param([*extra, "-1"], extra[-1], id=" ".join([*extra, "-1"])) for extra in EXTRA]
    return cases


class _TookTooLong(Exception):
    pass


@pytest.mark.parametrize("args, option", _cases())
def test_a_number_out_of_range_is_a_usage_error_before_any_work(args: list[str], option: str,
                                                                 tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    for env in ("GPIPE_REPRO_RESULTS", "GPIPE_REPRO_CACHE", "GPIPE_REPRO_DATA_DIR"):
        monkeypatch.setenv(env, str(tmp_path / env.lower()))
    monkeypatch.setenv("WANDB_MODE", "disabled")

    def too_long(*_: Any) -> None:
        raise _TookTooLong(f"`gpipe-repro {' '.join(args)}` was still running after {SECONDS} s: "
                           "it started work with a value its checks should have refused")
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(SECONDS)
    try:
        result = CliRunner().invoke(app, args, terminal_width=400)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    text = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2, (result.exit_code, text, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception      # no traceback
    assert re.search(rf"{re.escape(option)}(?![\w-])", text), f"{option} is not named: {text}"
