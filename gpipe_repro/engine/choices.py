"""One check for "this option takes one of these values", with one message everywhere.

A leaf module (no imports from the project): every layer may use it.
"""
from __future__ import annotations

from collections.abc import Collection


def require_one_of(name: str, value: object, choices: Collection[object]) -> None:
    """Raise ``ValueError("NAME must be one of CHOICES, got VALUE")`` unless `value` is in
    `choices`. Sets and mappings are listed sorted; sequences in their own order (the order a user
    reads in the documentation)."""
    if value in choices:
        return
    shown = sorted(choices, key=str) if isinstance(choices, (set, frozenset, dict)) else choices
    raise ValueError(f"{name} must be one of {shown}, got {value!r}")
