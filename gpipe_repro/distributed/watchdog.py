"""Failures in a pipeline job: end every stage process quickly, and say which rank failed and why.

A pipeline is a chain: when one stage process raises or is killed, its neighbours block on a receive
that will never complete, their neighbours block on them, and a naive job hangs forever with no
useful message. Three mechanisms together bound the time from any failure to the end of the job:

1. every communication op has a timeout (:mod:`gpipe_repro.distributed.process_group`), and a failed
   op raises :class:`PeerFailure` naming the peer. A process that exits closes its sockets, so gloo
   fails its neighbours' pending ops at once; a peer that is alive but stuck is caught by the timeout;
2. :func:`stage_main` wraps each stage process's main function: on any exception it prints
   ``[gpipe-repro] rank R failed: <cause>`` and the traceback to stderr, writes an error record (ours
   for :func:`~gpipe_repro.distributed.launcher.launch_local`, torchelastic's for torchrun), and exits
   with code 1 at once (``os._exit``: interpreter teardown could block on a dead peer);
3. the parent notices the first dead child and ends the others after a short grace period: our
   launcher does it (:mod:`gpipe_repro.distributed.launcher`), torchrun's elastic agent does the same.

The records let the parent tell the cause (an exception, a kill) from its consequences (neighbours
that lost their peer, ``kind == "peer"``) and report the rank where it started.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpipe_repro.distributed.launch_env import ERROR_FILE_ENV


class PeerFailure(RuntimeError):
    """A communication op failed because another rank died, failed or went silent."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


@dataclass
class ErrorRecord:
    """What a failing stage process leaves for its parent."""
    rank: int
    kind: str            # "error": this rank raised; "peer": it lost another rank (a consequence)
    message: str
    traceback: str
    time: float
    peer: int | None = None

    def save(self, path: str | os.PathLike[str]) -> None:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ErrorRecord | None:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError):
            return None


#: Errors whose message says what to change (the CLI prints them as one line, locally too).
USER_ERRORS = (ValueError, FileExistsError, FileNotFoundError, FloatingPointError, NotImplementedError)


def current_rank() -> int:
    """This process's rank, from torch.distributed if joined, else from $RANK (else 0)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", 0))


def stage_main(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `fn(*args, **kwargs)` as this stage process's main function (see the module docstring).

    Returns fn's result after leaving the process group. On any exception: report it and exit the
    process with code 1 immediately. Use it in torchrun scripts::

        if __name__ == "__main__":
            stage_main(main)
    """
    from gpipe_repro.distributed.process_group import shutdown
    try:
        result = fn(*args, **kwargs)
    except SystemExit as e:
        if e.code in (None, 0):   # sys.exit(0): a normal end
            shutdown()
            raise
        _fail(e)
    except BaseException as e:  # noqa: BLE001 - every failure must end the process, reported
        _fail(e)
    shutdown()
    return result


def _fail(error: BaseException) -> None:
    report_failure(error)
    sys.stdout.flush()
    os._exit(1)


#: What the communication backends say when the other end of an operation went silent or away
#: (gloo's timeouts and closed connections; NCCL's watchdog): raised by a collective the engine did not
#: wrap in a PeerFailure (an evaluation's, a user's own), it is still a consequence, not a cause.
_LOST_PEER = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
              "Socket Timeout", "Watchdog caught collective operation timeout")


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error` says this rank lost another one (a consequence of that rank's failure): a
    :class:`PeerFailure`, or a backend's communication error whose message says a peer went silent
    or closed its connection."""
    if isinstance(error, PeerFailure):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _LOST_PEER)


def report_failure(error: BaseException) -> ErrorRecord:
    """Print the failure to stderr and write the error records the parent reads."""
    rank = current_rank()
    peer = error.peer if isinstance(error, PeerFailure) else None
    record = ErrorRecord(rank, "peer" if lost_a_peer(error) else "error",
                         f"{type(error).__name__}: {error}", traceback.format_exc(), time.time(), peer)
    # A lost peer is a consequence, not a cause: one line is enough; so is an error the user can
    # fix (a bad value, a missing file, a diverged run: what the command line prints as one line
    # when run locally); any other cause gets its traceback.
    detail = ("" if record.kind == "peer" or isinstance(error, (*USER_ERRORS, KeyboardInterrupt))
              else f"\n{record.traceback}")
    print(f"[gpipe-repro] rank {rank} failed: {record.message}{detail}", file=sys.stderr, flush=True)
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        record.save(path)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
            ErrorHandler().record_exception(error)
        except Exception as e:  # noqa: BLE001 - the stderr report above already happened
            print(f"[gpipe-repro] rank {rank}: could not write torchelastic's error file: {e}",
                  file=sys.stderr, flush=True)
    return record
