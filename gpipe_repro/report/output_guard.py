"""Which files a command may replace where it was told to write.

Nothing a user owns is replaced. A command that writes to a path it was given checks, before any
work, every file it will write (`check_outputs`): a new path is fine; an existing one is replaced
only when it is the command's own previous output (its JSON says `"written_by": <command>`, or a
PNG carries the same text chunk, or the manifest JSON written with it does) AND the user passed
--overwrite. The results of record (the checkout's results/ folder) change only through their make
targets: a command given --record (what its make target passes) may replace its own output there; without it
nothing there is replaced, even with --overwrite.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from gpipe_repro.report import provenance
from gpipe_repro.report.records import RESULTS_ENV, read_json

OWNER_KEY = "written_by"


class OutputRefused(ValueError):
    """A path a command may not write to (the message says why and what to do)."""


def stamp(payload: Mapping[str, Any], command: str) -> dict[str, Any]:
    """`payload` marked as written by `command` (see `written_by`)."""
    return {**payload, OWNER_KEY: command}


def written_by(path: str | os.PathLike[str]) -> str | None:
    """The command that stamped `path` (a JSON file's "written_by", a PNG's "written_by" text
    chunk), or None (not stamped, unreadable, not JSON/PNG)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if head == _PNG_SIGNATURE:
                return _png_text(f).get(OWNER_KEY)
        data = read_json(path)
    except (OSError, ValueError):
        return None
    owner = data.get(OWNER_KEY) if isinstance(data, dict) else None
    return owner if isinstance(owner, str) else None


def owned_json(path: str | os.PathLike[str], command: str,
               legacy: Callable[[Mapping[str, Any]], bool] | None = None) -> bool:
    """Whether the JSON file `path` is `command`'s output: stamped by it, or (files written before
    the stamp existed) a dict `legacy` recognizes."""
    if written_by(path) == command:
        return True
    if legacy is None:
        return False
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and OWNER_KEY not in data and bool(legacy(data))


def checkout_results() -> Path | None:
    """The results of record: the results/ folder of the git checkout this package runs from, or None
    (an installed package has none)."""
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists() and (root / "Makefile").is_file():
        return root / "results"
    return None


def is_of_record(path: str | os.PathLike[str]) -> bool:
    """Whether `path` lies in the checkout's results/ folder (see `checkout_results`)."""
    record = checkout_results()
    if record is None:
        return False
    try:
        Path(path).resolve().relative_to(record.resolve())
    except ValueError:
        return False
    return True


def check_outputs(paths: Sequence[str | os.PathLike[str]], *, command: str, option: str,
                  overwrite: bool, own: Callable[[Path], bool] | None = None,
                  make_target: str | None = None, record: bool = False, clean: bool = True) -> None:
    """Refuse, before any work, to write `paths` unless each is new, or is `command`'s own previous
    output (`own(path)`; default: stamped by `command`) and --overwrite was given.

    `option` names the option the paths came from (for the message). `record=True` (--record, what
    the make target passes) replaces its own previous output without --overwrite, also in the
    results of record, and (`clean`) writes there only from a checkout whose tracked files are its
    commit's (the stamps name the commit: code that differs from it did not produce the figures);
    without it, a file in the results of record is never replaced (`make_target` names the target
    that does). Raises `OutputRefused` saying what to do.
    """
    is_own = own if own is not None else (lambda p: written_by(p) == command)
    files = [Path(p) for p in paths]
    for p in files:
        if p.is_dir():
            raise OutputRefused(f"{option} {p}: {p} is a directory, not a file: give a file path "
                                "(nothing was touched)")
        ancestor = p.parent
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if ancestor.exists() and not ancestor.is_dir():
            raise OutputRefused(f"{option} {p}: {ancestor} is a file, not a directory: choose another "
                                "path (nothing was touched)")
        if ancestor.exists() and not os.access(ancestor, os.W_OK | os.X_OK):
            raise OutputRefused(f"{option} {p}: cannot write in {ancestor} (permission denied): choose "
                                "another path (nothing was touched)")
    if record and clean and any(is_of_record(p) for p in files):
        changed = provenance.changed_files()
        if changed:
            where = next(p for p in files if is_of_record(p)).parent
            raise OutputRefused(
                f"writes results of record ({where}) only from a clean commit: {len(changed)} tracked "
                f"file(s) differ ({', '.join(changed[:5])}); commit or stash them, or write elsewhere "
                f"with {option + ' PATH or ' if option.startswith('--') else ''}{RESULTS_ENV}=DIR "
                "(nothing was run)")
    existing = [p for p in files if p.exists() or p.is_symlink()]
    if not existing:
        return
    foreign = [p for p in existing if not is_own(p)]
    if foreign:
        names = ", ".join(str(p) for p in foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise OutputRefused(f"{option}: {names} already exist{'s' if len(foreign) == 1 else ''} and "
                            f"{'is' if len(foreign) == 1 else 'are'} not a previous `gpipe-repro {command}` "
                            "output: choose another path, or move the file(s) away (nothing was "
                            "touched)")
    if record:
        return
    names = ", ".join(str(p) for p in existing[:4]) + (", ..." if len(existing) > 4 else "")
    recorded = [p for p in existing if is_of_record(p)]
    if recorded:
        how = f"`make {make_target}`" if make_target else "its make target"
        one = len(existing) == 1
        raise OutputRefused(f"{option}: {names} {'is a result' if one else 'are results'} of record, "
                            f"which change{'s' if one else ''} only through {how}: write elsewhere with "
                            f"{option} PATH or {RESULTS_ENV}=DIR (nothing was touched)")
    if not overwrite:
        raise OutputRefused(f"{option}: {names} hold{'s' if len(existing) == 1 else ''} a previous "
                            f"`gpipe-repro {command}` output: pass --overwrite to replace it, or choose "
                            "another path (nothing was touched)")


def check_manifest_outputs(manifest: Path, pages: Sequence[Path], *, command: str, option: str,
                           overwrite: bool, record: bool,
                           legacy: Callable[[Any], bool] | None = None, clean: bool = True) -> None:
    """:func:`check_outputs` for a command's JSON `manifest` and the `pages` it writes beside it:
    each is the command's own where the manifest is (stamped by it, or, from before the stamps,
    a dict `legacy` recognizes); the command's make target has its own name."""
    check_outputs([manifest, *pages], command=command, option=option, overwrite=overwrite,
                  own=lambda _: owned_json(manifest, command, legacy), make_target=command,
                  record=record, clean=clean)


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_text(f: IO[bytes]) -> dict[str, str]:
    """The tEXt chunks of a PNG file positioned after its signature (stops at the image data)."""
    out: dict[str, str] = {}
    while True:
        header = f.read(8)
        if len(header) < 8:
            return out
        length, kind = int.from_bytes(header[:4], "big"), header[4:]
        if kind in (b"IDAT", b"IEND") or length > 1 << 20:
            return out
        data = f.read(length)
        f.read(4)  # CRC
        if kind == b"tEXt":
            key, _, value = data.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
