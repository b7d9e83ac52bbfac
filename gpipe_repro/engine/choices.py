"""One check for "this option takes one of these values", with one message everywhere.

A leaf module (no imports from the project): every layer may use it.
"""
from __future__ import annotations

import difflib
from collections.abc import Collection


def did_you_mean(value: object, choices: Collection[object]) -> str:
    """``"; did you mean 'gpipe'?"`` for the choice closest to a mistyped `value` (case aside), else
    ``""``."""
    if not isinstance(value, str):
        return ""
    names = {str(c).lower(): str(c) for c in choices}
    close = difflib.get_close_matches(value.lower(), list(names), n=1, cutoff=0.6)
    return f"; did you mean {names[close[0]]!r}?" if close else ""


def require_one_of(name: str, value: object, choices: Collection[object]) -> None:
    """Raise ``ValueError("NAME must be one of CHOICES, got VALUE")`` unless `value` is in
    `choices` (with the closest choice, where one is close: :func:`did_you_mean`). Sets and mappings
    are listed sorted; sequences in their own order (the order a user reads in the documentation)."""
    if value in choices:
        return
    shown = sorted(choices, key=str) if isinstance(choices, (set, frozenset, dict)) else choices
    raise ValueError(f"{name} must be one of {shown}, got {value!r}{did_you_mean(value, choices)}")
