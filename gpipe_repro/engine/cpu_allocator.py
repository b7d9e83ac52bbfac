"""Keep freed CPU memory in the process, so a training step does not page-fault on every micro-batch.

Why: glibc's ``malloc`` gives large freed blocks back to the kernel (a block above the mmap threshold
is unmapped when freed, the top of the heap is trimmed above the trim threshold), and the threshold
adapts only up to the largest block freed so far. A pipeline stage allocates and frees the same
activation and gradient buffers for every micro-batch, so every allocation page-faults again and the
kernel zeroes every page again. Measured on this project's 2-core host (one thread, steady state,
full training steps of a mini-batch of 256): a conv net of 6 x
32 channels on 16x16 images at micro-batches of 128 rows took 216 ms and 39,000 minor page faults per
step with glibc's defaults, 157 ms and ~170 faults with freed memory kept (-27%); a residual MLP of
width 1024 at 32 rows, 873 ms and 42,000 faults against 813 ms and none (-7%). Per-layer costs timed
in isolation (a calibration) reuse the same few buffers and never pay this, so before this setting
the simulator underestimated real stage processes by 15-45% on such models
(``results/throughput/validation_unseen.md``).

What :func:`keep_freed_memory` sets (``mallopt(3)``): ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's
largest, which also stops its dynamic adjustment), ``M_TRIM_THRESHOLD`` = 2 GiB - 1 and
``M_TOP_PAD`` = 64 MiB. Freed memory stays in the process for the next micro-batch: the resident size
stays near the step's peak instead of shrinking between micro-batches, as the CUDA caching allocator
does on a GPU; the peak itself does not grow. Blocks above 32 MiB are still mapped and unmapped each
time.

Where it applies: every CPU stage process when it joins the job
(:func:`gpipe_repro.distributed.init_distributed`), and the processes that time layer costs for the
simulator, so both measure the same allocator. ``GPIPE_REPRO_KEEP_FREED_MEMORY=0`` turns it off
(both places, so the simulator still models what runs). Elsewhere than Linux with glibc it does
nothing. It is process-wide and cannot be undone, which is why :class:`gpipe_repro.GPipe` does not
call it in a user's own process on its own: call it yourself for the local runtime on a CPU.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

ENV = "GPIPE_REPRO_KEEP_FREED_MEMORY"

# mallopt(3) parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 64 << 20))


def enabled() -> bool:
    """Whether :func:`keep_freed_memory` will change anything ($GPIPE_REPRO_KEEP_FREED_MEMORY,
    default on; glibc only)."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on", ""):
        raise ValueError(f"${ENV}={os.environ[ENV]!r}: use 1 (keep freed memory, the default) or 0 "
                         "(glibc's defaults)")
    return value not in ("0", "false", "no", "off") and platform.libc_ver()[0] == "glibc"


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Set this process's malloc to keep freed memory (see the module docstring). Idempotent;
    returns whether the settings are in effect."""
    if not enabled():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)


def describe() -> str:
    """A few words for a measurement's record: which allocator settings it ran under."""
    return ("malloc keeps freed memory (mmap threshold 32 MiB, no trim)" if enabled()
            else "glibc malloc defaults")
