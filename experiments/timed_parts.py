"""Parts of a long regeneration run one after another, each a child process with a time limit.

A part is a command (an argv) with a wall-clock limit. :func:`run_part` starts it in its own process
group, passes its output through line by line (prefixed with the part's name), prints a plain
progress line at least every `progress_every` seconds (what a log or CI sees when the child is
silent: a rich status line is not drawn when output is not a terminal), and kills the whole group
when the limit passes. The outcome says what happened; the caller records it and goes on.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

PROGRESS_EVERY_S = 30.0


@dataclasses.dataclass(frozen=True)
class Part:
    """One step of a regeneration: `argv` run from the repository root within `limit_s` seconds."""

    name: str
    argv: tuple[str, ...]
    limit_s: float
    outputs: tuple[str, ...] = ()        # folders (under the results root) the part writes to
    note: str = ""

    def command_line(self) -> str:
        return " ".join(self.argv)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a part ended: "ok", "failed" (non-zero exit status) or "timed out" (killed at its limit)."""

    name: str
    status: str
    returncode: int | None
    seconds: float
    tail: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "returncode": self.returncode,
                "seconds": round(self.seconds, 1), "last_output": list(self.tail)}


def check_parts(parts: Sequence[Part], total_limit_s: float) -> None:
    """Refuse a plan whose names repeat or whose limits add up to more than `total_limit_s`."""
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"part names repeat: {names}")
    total = sum(p.limit_s for p in parts)
    if total > total_limit_s:
        raise ValueError(f"the parts' limits add up to {total:.0f} s, over the {total_limit_s:.0f} s "
                         "allowed: lower some part's limit")


def plan_lines(parts: Sequence[Part], total_limit_s: float) -> list[str]:
    """What a dry run prints: each part's limit and command, then the total."""
    width = max((len(p.name) for p in parts), default=0)
    lines = [f"{i + 1:2d}. {p.name:<{width}}  {p.limit_s:5.0f} s  {p.command_line()}"
             + (f"   ({p.note})" if p.note else "") for i, p in enumerate(parts)]
    total = sum(p.limit_s for p in parts)
    lines.append(f"total {total:.0f} s of the {total_limit_s:.0f} s allowed ({total / 60:.1f} min)")
    return lines


def run_part(part: Part, *, cwd: Path, env: Mapping[str, str] | None = None, out: TextIO | None = None,
             progress_every: float = PROGRESS_EVERY_S, header: str = "",
             clock: Callable[[], float] = time.monotonic) -> Outcome:
    """Run `part` to its end or its limit; its output goes to `out` (default stdout) as it comes."""
    stream = out or sys.stdout
    tail: list[str] = []
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            stream.write(line + "\n")
            stream.flush()

    t0 = clock()
    try:
        proc = subprocess.Popen(list(part.argv), cwd=cwd, env=dict(env) if env is not None else None,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)
    except OSError as e:
        say(f"[{part.name}] could not start: {e}")
        return Outcome(part.name, "failed", None, 0.0, (str(e),))

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            tail.append(line)
            del tail[:-20]
            say(f"[{part.name}] {line}")
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    status = None
    next_progress = t0 + progress_every
    while status is None:
        now = clock()
        deadline = t0 + part.limit_s
        try:
            proc.wait(timeout=max(0.05, min(next_progress, deadline) - now))
            status = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            now = clock()
            if now >= deadline:
                _kill_group(proc)
                status = "timed out"
            elif now >= next_progress:
                say(f"{header}{part.name}: running, {now - t0:.0f} s of its {part.limit_s:.0f} s")
                next_progress = now + progress_every
    reader.join(timeout=5)
    return Outcome(part.name, status, proc.returncode, clock() - t0, tuple(tail))


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Stop the part and everything it started (its own process group): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
