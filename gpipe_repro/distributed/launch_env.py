"""Environment variables through which a launcher configures its stage processes.

They live apart from the modules that read them so that a launcher (the CLI's parent process) can
name them without importing torch.
"""
from __future__ import annotations

TIMEOUT_ENV = "GPIPE_REPRO_TIMEOUT_S"     # seconds before a silent peer counts as failed
THREADS_ENV = "GPIPE_REPRO_THREADS"       # intra-op threads per stage process on CPU
ERROR_FILE_ENV = "GPIPE_REPRO_ERROR_FILE"  # where a failing stage process leaves its ErrorRecord
BACKEND_ENV = "GPIPE_REPRO_BACKEND"       # "gloo" or "nccl"; unset: NCCL when every local process has a GPU
DEFAULT_TIMEOUT_S = 600.0
"""Seconds before a communication op with a silent peer fails, unless the launcher or
$GPIPE_REPRO_TIMEOUT_S says otherwise: a peer may be computing, compiling or writing a checkpoint
for minutes while its neighbour waits (torch.distributed's NCCL default is the same 10 minutes). A
peer that dies is noticed at once (its sockets close), whatever this says."""
