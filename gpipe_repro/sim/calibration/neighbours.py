"""Measurement conditions: the other cores of a pipeline kept busy while a layer is timed."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine import cpu_allocator
from gpipe_repro.engine.batchnorm import DeferredBatchNorm
from gpipe_repro.models.workload import Workload


def _busy_loop(workload: Workload, size: int, stop: Any, ready: Any, lifeline: Any) -> None:
    """Train `workload` on micro-batches of `size` (a pipeline's other stage) until `stop` is set or
    the calibrating process is gone (`lifeline`, the read end of a pipe whose only write end it
    holds, reads end-of-file)."""
    import signal
    # the fork server it comes from ignores SIGTERM (so may a caller): the calibration must be able
    # to end its neighbour
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)
    cpu_allocator.keep_freed_memory()     # a stage process runs with it (engine/cpu_allocator.py)
    model = nn.Sequential(*[DeferredBatchNorm.convert(layer) for layer in workload.build("cpu")])
    x, y = workload.sample(size)
    loss_fn = workload.loss_fn()
    first = True
    # Ends with its calibration: when `stop` is set, or when the calibrating process is gone (killed
    # before it could set it, also while this one started: the pipe's end-of-file stays).
    while not stop.is_set() and not lifeline.poll():
        loss_fn(model(x), y).backward()
        model.zero_grad(set_to_none=True)
        if first:
            ready.put(True)
            first = False


@contextlib.contextmanager
def busy_neighbours(workload: Workload, size: int, count: int) -> Iterator[None]:
    """Keep `count` other cores busy training the same model while the body runs.

    Why: the stages of a pipeline compute at the same time, and cores that share caches, memory
    bandwidth (or, in a VM, a physical core) slow each other down; a layer timed on an otherwise idle
    host runs faster than it does inside a running pipeline (5-15% on this project's 2-core host).
    Timing with the neighbouring cores busy measures the cost in the pipeline's steady state.
    """
    if count <= 0:
        yield
        return
    from gpipe_repro.distributed.launcher import preloaded_forkserver

    ctx = preloaded_forkserver()
    stop, ready = ctx.Event(), ctx.Queue()
    lifeline, alive = ctx.Pipe(duplex=False)     # this process holds the only write end
    procs = [ctx.Process(target=_busy_loop, args=(workload, size, stop, ready, lifeline), daemon=True)
             for _ in range(count)]
    for p in procs:
        p.start()
    lifeline.close()
    try:
        _wait_ready(procs, ready)
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():        # a neighbour must never outlive its calibration
                p.kill()
                p.join(timeout=5)
        alive.close()




def _wait_ready(procs: list[Any], ready: Any, timeout_s: float = 300.0) -> None:
    """Wait until every neighbour trains; fail at once, naming the cause, if one died starting."""
    import queue
    import time

    deadline = time.monotonic() + timeout_s
    started = 0
    while started < len(procs):
        try:
            ready.get(timeout=0.5)
            started += 1
            continue
        except queue.Empty:
            pass
        dead = [p.exitcode for p in procs if not p.is_alive()]
        if dead:
            raise RuntimeError(
                f"a busy-neighbour process of the calibration exited with code {dead[0]} before "
                "training (its error is printed above). It is started from multiprocessing's fork server: "
                "the calling script must be importable (not stdin) and guard its entry point with "
                "`if __name__ == '__main__':`; or calibrate with neighbours=0")
        if time.monotonic() > deadline:
            raise RuntimeError(f"busy-neighbour processes did not start training within {timeout_s:.0f} s")
