"""Joining the job: one process per pipeline stage, rank = stage.

Why a helper and not a bare ``init_process_group``: every stage process must agree on three things
that torch leaves to the caller, and getting any of them wrong shows up much later as a hang or a
slow run, not an error:

- the backend and device: NCCL with ``cuda:LOCAL_RANK`` when every process of this host can have a
  GPU of its own (``torch.cuda.device_count() >= LOCAL_WORLD_SIZE``), gloo on CPU otherwise, with a
  warning when GPUs are visible but too few (NCCL cannot put two ranks on one GPU). ``backend=`` or
  ``GPIPE_REPRO_BACKEND`` chooses explicitly; asking for NCCL with too few GPUs fails before the
  process group forms, on every rank, saying what to change;
- a timeout on every communication op (gloo's default is 30 minutes; a pipeline whose neighbour died
  should fail in seconds), taken from ``GPIPE_REPRO_TIMEOUT_S`` when the launcher set it;
- on CPU, the number of intra-op threads (``GPIPE_REPRO_THREADS``, default 1): K stage processes on one
  host each spawning one thread per core would oversubscribe the cores and measure nothing useful;
- on CPU, malloc keeps freed memory (:func:`gpipe_repro.engine.cpu_allocator.keep_freed_memory`):
  with glibc's defaults every micro-batch page-faults its activations in again (7-27% of a step
  measured; ``GPIPE_REPRO_KEEP_FREED_MEMORY=0`` turns it off).

Rendezvous is torch's own ``env://`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so
``torchrun --nproc-per-node K script.py``, ``torchrun --nnodes N ...`` and
:func:`gpipe_repro.distributed.launcher.launch_local` all work unchanged.
"""
from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpipe_repro.distributed.launch_env import BACKEND_ENV, DEFAULT_TIMEOUT_S, THREADS_ENV, TIMEOUT_ENV
from gpipe_repro.distributed.watchdog import PeerFailure
from gpipe_repro.engine import cpu_allocator


@dataclass(frozen=True)
class StageContext:
    """Where this process sits in the job."""
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    timeout_s: float


_context: StageContext | None = None
_gloo: dist.ProcessGroup | None = None   # CPU group for control messages when the backend is NCCL


def init_distributed(backend: str | None = None, timeout_s: float | None = None,
                     threads: int | None = None) -> StageContext:
    """Join (or describe the already joined) default process group. Idempotent.

    `backend`: "gloo" or "nccl"; default $GPIPE_REPRO_BACKEND, else :func:`choose_backend`.
    `timeout_s`: seconds before a communication op with a silent peer fails (default
    $GPIPE_REPRO_TIMEOUT_S, else :data:`~gpipe_repro.distributed.launch_env.DEFAULT_TIMEOUT_S`).
    `threads`: intra-op threads on CPU (default $GPIPE_REPRO_THREADS, else 1; 0 leaves torch's
    default).
    """
    global _context
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    if threads is None:
        threads = int(os.environ.get(THREADS_ENV, 1))
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; install a build with it")
    if dist.is_initialized():
        backend = str(dist.get_backend())
    else:
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise RuntimeError(
                    f"${var} is not set: start the stage processes with "
                    "`torchrun --nproc-per-node K script.py` or "
                    "gpipe_repro.distributed.launch_local(fn, K), or initialize torch.distributed "
                    "yourself before building the pipeline")
        backend = backend or os.environ.get(BACKEND_ENV) or choose_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r} "
                         f"(from backend= or ${BACKEND_ENV})")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if "TORCHELASTIC_RUN_ID" in os.environ:   # started by torchrun: end with it
        watch_parent()
    if backend == "nccl" and not dist.is_initialized():
        _check_gpus_for_nccl(local_rank)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if threads > 0:
            torch.set_num_threads(threads)
        cpu_allocator.keep_freed_memory()     # no page faults on every micro-batch (see the module)
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=device if backend == "nccl" else None)
        except (dist.DistStoreError, dist.DistNetworkError) as e:   # a rank that never joined (rank
            # 0 hosts the rendezvous: a client that cannot reach it waited for it): not this one's fault
            raise PeerFailure(f"rank {os.environ.get('RANK')} waited {timeout_s:g} s for the other "
                              f"ranks of the job to join, and some never did "
                              f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}). "
                              "A rank that takes longer to reach GPipe(...) (loading data or weights) "
                              "needs a longer timeout: launch_local(..., timeout=S) or "
                              "GPIPE_REPRO_TIMEOUT_S") from e
    _context = StageContext(dist.get_rank(), dist.get_world_size(), local_rank, backend, device,
                            timeout_s)
    return _context


def _local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def choose_backend() -> str:
    """NCCL when every stage process of this host can have a GPU of its own, else gloo on the CPU.

    NCCL refuses two ranks on one GPU, so with more processes on this host than visible GPUs (two
    stages on a one-GPU workstation) the job runs on the CPU over gloo, and says so once (local rank 0).
    """
    if not torch.cuda.is_available():
        return "gloo"
    gpus, local = torch.cuda.device_count(), _local_world_size()
    if gpus >= local:
        return "nccl"
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        warnings.warn(f"{local} stage processes on this host but {gpus} GPU(s) visible: NCCL needs one "
                      f"GPU per process, so this job runs on the CPU over gloo. Run at most {gpus} "
                      f"process(es) per host to use the GPUs, or set {BACKEND_ENV}=gloo to choose the "
                      "CPU explicitly and silence this warning.", RuntimeWarning, stacklevel=3)
    return "gloo"


def _check_gpus_for_nccl(local_rank: int) -> None:
    """Fail on every rank, before the process group forms, when NCCL cannot give each local process a
    GPU (otherwise ranks past the GPU count die in CUDA with 'invalid device ordinal' while the others
    wait for them)."""
    gpus, local = (torch.cuda.device_count() if torch.cuda.is_available() else 0), _local_world_size()
    if gpus == 0:
        raise RuntimeError(f"backend 'nccl' needs a GPU, and this process sees none; use gloo on the "
                           f"CPU ({BACKEND_ENV}=gloo or backend='gloo')")
    if gpus < max(local, local_rank + 1):
        raise RuntimeError(
            f"backend 'nccl' needs one GPU per stage process: this host runs {max(local, local_rank + 1)} "
            f"process(es) and sees {gpus} GPU(s). Run at most {gpus} process(es) per host "
            f"(torchrun --nproc-per-node), or use gloo on the CPU ({BACKEND_ENV}=gloo).")


_parent_watch: threading.Thread | None = None


def watch_parent(interval_s: float = 1.0) -> None:
    """End this process within `interval_s` of its parent's death (idempotent).

    A stage process started by torchrun would otherwise outlive a torchrun killed with SIGKILL (its
    agent cannot stop the workers then): reparented to init, the workers went on training, holding
    the port and the memory. The launcher of this project has its own
    lifeline (:mod:`gpipe_repro.distributed.launcher`); this is torchrun's. A thread polls the
    parent pid: once it changes, the parent is gone, and the process kills its own group if it
    leads one (what it started: wandb-core), else itself."""
    global _parent_watch
    if _parent_watch is not None:
        return
    parent = os.getppid()
    if not _is_torchrun(parent):   # a process a worker started (its own eval job, say): not ours
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        print(f"[gpipe-repro] rank {os.environ.get('RANK', '?')}: its launcher (pid {parent}) is "
              "gone, stopping", file=sys.stderr, flush=True)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    _parent_watch = threading.Thread(target=watch, daemon=True, name="gpipe-parent-watch")
    _parent_watch.start()


def _is_torchrun(pid: int) -> bool:
    """Whether process `pid` is torchrun (its command line runs torch.distributed.run)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ")
    except OSError:
        return False
    return b"torchrun" in command or b"torch.distributed.run" in command \
        or b"torch/distributed/run.py" in command


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a collective: every rank calls it)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (a collective: every rank calls it)."""
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, obj, group=control_group())
    return box


def control_group() -> dist.ProcessGroup | None:
    """The group for small control messages (objects, the loss, clock pings): the default group on
    gloo; on NCCL a gloo group over the same ranks, created once (collectively) on first use."""
    global _gloo
    if dist.get_backend() == "gloo":
        return None
    if _gloo is None:
        _gloo = dist.new_group(backend="gloo")
    return _gloo


def current_context() -> StageContext | None:
    """The context of the last :func:`init_distributed` in this process, if any."""
    return _context if dist.is_available() and dist.is_initialized() else None


def shutdown() -> None:
    """Leave the process group (at the end of a stage process)."""
    global _context, _gloo
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _context, _gloo = None, None
