"""The schedule's text form and picture.

One line per stage (``stage 0: F0 sa0 F1 sa1 rg1 B1 rg0 B0 A U``), or one per process when stages
share processes (``process 0: F0@0 ...``); :func:`from_text` reads what :func:`to_text` writes
(the form is described in :mod:`gpipe_repro.engine.schedule`). :func:`render` draws the unit-time run.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from gpipe_repro.engine.schedule.actions import _SHORT, COMPUTE, Action, ScheduleError
from gpipe_repro.engine.schedule.core import Schedule

__all__ = ["to_text", "from_text", "render"]


def render(schedule: Schedule, duration: Callable[[Action], float] | None = None) -> str:
    """ASCII picture of `schedule`: one row per stage (per process when stages share processes),
    one column per unit of time, compute actions only."""
    from gpipe_repro.engine.interpreter import run_dataflow
    events = run_dataflow(schedule, duration=duration or _unit_compute)
    cols = max(int(round(e.end)) for e in events)
    owner, shared = schedule.process_of(), schedule.processes is not None
    grid = [["." for _ in range(cols)] for _ in range(len(schedule.programs()))]
    label = (lambda a: f"{a}@{a.stage}") if shared else str
    for e in events:
        if e.action.kind in COMPUTE:
            for c in range(int(round(e.start)), int(round(e.end))):
                grid[owner[e.action.stage]][c] = label(e.action)
    width = max(len(label(a)) for st in schedule.stages for a in st if a.kind in COMPUTE)
    row_name = "process" if shared else "stage"
    rows = [f"{row_name} {s} |" + " ".join(c.ljust(width) for c in row) + " |"
            for s, row in enumerate(grid)]
    return "\n".join(rows)


def to_text(schedule: Schedule, mark: Iterable[Action] = ()) -> str:
    """The schedule in its text form (see the module docstring); actions in `mark` are
    bracketed ``>>F3<<`` and their lines end with ``<-- ERROR``."""
    marked = set(mark)
    lines = [f"schedule {schedule.name} stages={schedule.num_stages} "
             f"micro_batches={schedule.num_microbatches} training={int(schedule.training)}"]
    if schedule.processes is not None:   # stages sharing processes: one line per process, X@stage
        lines[0] += f" processes={len(schedule.processes)}"
        for p, actions in enumerate(schedule.processes):
            tokens = [f">>{a}@{a.stage}<<" if a in marked else f"{a}@{a.stage}" for a in actions]
            flag = "   <-- ERROR" if any(a in marked for a in actions) else ""
            lines.append(f"process {p}: {' '.join(tokens)}{flag}".rstrip())
        return "\n".join(lines)
    for s, actions in enumerate(schedule.stages):
        tokens = [f">>{a}<<" if a in marked else str(a) for a in actions]
        flag = "   <-- ERROR" if any(a.stage == s for a in marked) else ""
        lines.append(f"stage {s}: {' '.join(tokens)}{flag}".rstrip())
    return "\n".join(lines)


def from_text(text: str) -> Schedule:
    """Parse :meth:`to_text`'s form (blank lines and ``#`` comments are ignored). Raises
    ScheduleError naming the line for anything it cannot read; it does not validate (call
    :meth:`validate` for that), so broken schedules can be written down and checked."""
    lines = [(i + 1, ln.split("#", 1)[0].strip()) for i, ln in enumerate(text.splitlines())]
    lines = [(i, ln) for i, ln in lines if ln]
    if not lines or not lines[0][1].startswith("schedule "):
        raise ScheduleError("schedule text must start with 'schedule NAME stages=K micro_batches=M "
                            "training=1'")
    head = lines[0][1].split()
    fields = dict(f.split("=", 1) for f in head[2:] if "=" in f)
    try:
        k, m = int(fields["stages"]), int(fields["micro_batches"])
        training = bool(int(fields.get("training", "1")))
    except (KeyError, ValueError):
        raise ScheduleError(f"line {lines[0][0]}: cannot read {lines[0][1]!r}: expected "
                            "'schedule NAME stages=K micro_batches=M training=1'") from None
    if "processes" in fields:
        return _from_process_text(head[1], k, m, training, lines[1:])
    stages = _read_rows(lines[1:], "stage", "actions...", _parse_action)
    if sorted(stages) != list(range(k)):
        raise ScheduleError(f"the header says stages={k} but the text lists stages {sorted(stages)}")
    return Schedule(head[1], k, m, tuple(stages[s] for s in range(k)), training)


def _from_process_text(name: str, k: int, m: int, training: bool,
                       lines: list[tuple[int, str]]) -> Schedule:
    programs = _read_rows(lines, "process", "actions@stage...", _parse_placed_action)
    procs = tuple(programs[p] for p in sorted(programs))
    stages = tuple(tuple(a for prog in procs for a in prog if a.stage == s) for s in range(k))
    return Schedule(name, k, m, stages, training, procs)


def _read_rows(lines: list[tuple[int, str]], row: str, form: str,
               parse: Callable[[str, int, int], Action]) -> dict[int, tuple[Action, ...]]:
    """The rows ``ROW N: tokens`` (``row`` is "stage" or "process") as {N: actions}, each token read
    by ``parse(token, N, line number)``; a malformed or repeated row names its line."""
    rows: dict[int, tuple[Action, ...]] = {}
    for lineno, ln in lines:
        label, sep, body = ln.partition(":")
        if not sep or not re.fullmatch(rf"{row} \d+", label.strip()):
            raise ScheduleError(f"line {lineno}: expected '{row} N: {form}', got {ln!r}")
        n = int(label.split()[1])
        if n in rows:
            raise ScheduleError(f"line {lineno}: {row} {n} is listed twice")
        rows[n] = tuple(parse(tok, n, lineno) for tok in body.replace("<-- ERROR", "").split())
    return rows


def _parse_placed_action(token: str, process: int, lineno: int) -> Action:
    """An action of a process row, ``F3@2`` (optionally marked ``>>F3@2<<``): it names its stage."""
    bare = token[2:-2] if token.startswith(">>") and token.endswith("<<") else token
    action, at, stage = bare.rpartition("@")
    if not at or not stage.isdigit():
        raise ScheduleError(f"line {lineno}: {token!r} needs its stage: write e.g. F3@2")
    return _parse_action(action, int(stage), lineno)


_FROM_SHORT = {short: kind for kind, short in _SHORT.items()}


def _parse_action(token: str, stage: int, lineno: int) -> Action:
    match = re.fullmatch(r">>(.*)<<|(.*)", token)
    body = (match.group(1) or match.group(2)) if match else token
    parsed = re.fullmatch(r"([A-Za-z_]+?)(\d*)", body)
    if parsed is None or parsed.group(1) not in _FROM_SHORT:
        raise ScheduleError(f"line {lineno}: unknown action {token!r}: use one of "
                            f"{sorted(_FROM_SHORT)} followed by a micro-batch number")
    kind, digits = _FROM_SHORT[parsed.group(1)], parsed.group(2)
    return Action(kind, stage, int(digits) if digits else None)


def _unit_compute(a: Action) -> float:
    return 1.0 if a.kind in COMPUTE else 0.0

