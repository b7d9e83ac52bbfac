"""Re-materialization state: is the current forward a recomputation?

During a recompute the engine re-runs a cell's forward to rebuild its autograd graph. Layers with side
effects (running statistics, counters, logging) should do them once, in the original forward; they ask
:func:`is_recomputing`. The flag is thread-local so concurrent stages never see each other's state.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["is_recomputing", "recomputing"]

_state = threading.local()


def is_recomputing() -> bool:
    """True while the engine is recomputing a checkpointed forward for its backward."""
    return getattr(_state, "recomputing", False)


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark the enclosed forward as a recomputation (see :func:`is_recomputing`)."""
    previous = is_recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous
