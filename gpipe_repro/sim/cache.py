"""Where calibrations and link measurements are cached on disk."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where calibrations and link measurements are cached."""
    root = os.environ.get("GPIPE_REPRO_CACHE") or Path.home() / ".cache" / "gpipe-repro"
    return Path(root)

