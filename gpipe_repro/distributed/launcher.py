"""The local launcher: K stage processes on this host, without torchrun.

::

    from gpipe_repro.distributed import launch_local

    def train(steps: int) -> float:          # runs in every stage process, rank = stage
        pipe = GPipe(layers(), partitions=2, micro_batches=8, runtime="distributed", ...)
        return [pipe.train_step(x, y) for _ in range(steps)][-1]

    losses = launch_local(train, 2, 10, timeout=30)   # [loss of rank 0, loss of rank 1]

What it does: picks a free port, starts `nprocs` processes with torch's ``env://`` variables set
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), runs ``fn(*args)`` in each under
:func:`~gpipe_repro.distributed.watchdog.stage_main`, and returns the per-rank results (pickled back
through files), in rank order. `fn` and `args` must be picklable: a module-level function.

Why not ``torch.multiprocessing.spawn``: it does not bound the time to end a job after a failure nor
report the root cause when several ranks die. Here the parent watches every child: when one dies it
gives the others `grace` seconds to exit on their own (their communication fails at once when a peer
dies), then kills them, and raises :class:`JobFailed` naming the rank where the failure started (an
exception, a signal, or, if every failure is a lost peer, a rank found stopped (SIGSTOP), else the end
of the chain of ranks that timed out waiting for one another: see `_root_cause`) with its cause; the
same line goes to stderr. `timeout` is the communication timeout inside the job (a rank that stops
answering is declared lost after it), so a job with a failed or stuck rank ends within about
``timeout + grace`` seconds. `job_timeout` optionally bounds the whole run.

Signals and the launcher's own death. Each stage process leads its own process group (so its
children, such as rank 0's wandb-core, go with it). A SIGINT/SIGTERM that reaches the launcher is
forwarded to every stage's group (`forward_signals`), so a job that handles them (the training
loop: finish the step, save, stop) does so on every rank together; a terminal's Ctrl-C reaches the
launcher alone and is forwarded once. If the launcher dies without warning (SIGKILL), every stage
sees its end of a pipe close and kills its process group at once: nothing is left running.

Processes start from a fork server that has imported torch once (``start_method="forkserver"``), so
a second launch in the same program starts in well under a second instead of re-importing torch; use
``"spawn"`` for the most isolated start.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from gpipe_repro.distributed.launch_env import DEFAULT_TIMEOUT_S, ERROR_FILE_ENV, THREADS_ENV, TIMEOUT_ENV
from gpipe_repro.distributed.watchdog import ErrorRecord, stage_main

# torch._dynamo: the first optimizer a process builds imports it (seconds); pay that once, here.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "gpipe_repro.engine.gpipe",
            "gpipe_repro.distributed.runtime"]


def preloaded_forkserver() -> Any:
    """multiprocessing's forkserver context whose server has imported torch and the engine once: a
    process started from it is ready in a fraction of a second, not the seconds a fresh interpreter
    takes to import torch (what spawn pays per process). Its targets and arguments are pickled, and
    the calling script's ``__main__`` is imported in the child, as with spawn."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class JobFailed(RuntimeError):
    """A stage process failed; `rank` is where the failure started, `cause` what happened."""

    def __init__(self, rank: int, cause: str, details: str = "") -> None:
        super().__init__(f"rank {rank} failed: {cause}" + (f"\n{details}" if details else ""))
        self.rank, self.cause = rank, cause
        #: the signal the launcher had passed on to the stages before they failed (SIGINT: a
        #: Ctrl-C the stages did not turn into a graceful stop), else None
        self.signal: int | None = None


@dataclass
class _Exit:
    rank: int
    code: int
    seen: float
    record: ErrorRecord | None
    returned: bool = True       # code 0: its function returned (else sys.exit(0) or os._exit(0) in it)

    @property
    def failed(self) -> bool:
        return self.code != 0 or not self.returned


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous port of rank 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> None:
    """Refuse, before any process starts, what the stage processes could not receive: they are new
    interpreters (forkserver, spawn) that get `fn` and `args` by pickling, and a function defined
    inside another one or a lambda cannot be pickled (multiprocessing said "Can't pickle local
    object" from deep inside its start); a function of a program's ``__main__`` is found by
    importing the program's file again, and a program read from stdin, ``python -c`` or a notebook
    has none (each stage died with a FileNotFoundError or AttributeError of its own, and the job
    failed "without reporting an error"); a program read from stdin is run again by every process
    multiprocessing starts, whatever the function."""
    name = getattr(fn, "__qualname__", fn)
    try:
        sent = pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(f"launch_local({name!r}, ...): the stage processes "
                         "receive the function by pickling, and it cannot be pickled: define it at "
                         f"the top level of an importable module (not inside a function, not a "
                         f"lambda) ({e})") from None
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file and os.path.isfile(main_file):
        return
    with contextlib.suppress(Exception):    # what plain pickle cannot take, multiprocessing may
        sent += pickle.dumps(args)
    # a __main__ with a __file__ that is none (stdin's "<stdin>") is run again by every new process
    if main_file or b"__main__" in sent:
        raise ValueError(f"launch_local({name!r}, ...): the stage processes import this program's "
                         f"__main__ (the function, an argument, or the program itself), which has no "
                         f"file they can import "
                         f"({main_file or 'stdin, python -c or a notebook'}): save the program as a "
                         ".py file and run `python file.py`, or define the function in a module and "
                         "import it")


def launch_local(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float | None = None,
                 grace: float = 2.0, job_timeout: float | None = None, threads: int = 1,
                 start_method: str = "forkserver", env: dict[str, str] | None = None,
                 forward_signals: bool = True) -> list[Any]:
    """Run ``fn(*args)`` in `nprocs` stage processes on this host; return their results by rank.

    `timeout`: communication timeout inside the job (seconds; see the module docstring; default
    $GPIPE_REPRO_TIMEOUT_S, else :data:`~gpipe_repro.distributed.launch_env.DEFAULT_TIMEOUT_S`). `grace`:
    seconds the others get to exit after the first failure before they are killed. `job_timeout`:
    kill everything and fail after this many seconds (None: no limit). `threads`: intra-op threads per
    process on CPU. `env`: extra environment variables for the children. `forward_signals`: pass a
    SIGINT/SIGTERM the launcher receives on to every stage (when called from the main thread).
    Raises :class:`JobFailed`.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if start_method != "fork":
        _check_picklable(fn, args)
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    ctx: Any = preloaded_forkserver() if start_method == "forkserver" else mp.get_context(start_method)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gpipe-launch-") as tmp:
        procs: list[Any] = []
        # The launcher holds the only write end: when it dies, every stage reads EOF (see _child).
        lifeline_r, lifeline_w = ctx.Pipe(duplex=False)
        try:
            with _sigint_held(forkserver=start_method == "forkserver"):
                for rank in range(nprocs):
                    child_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                                 "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
                                 "MASTER_PORT": str(port), TIMEOUT_ENV: str(timeout),
                                 THREADS_ENV: str(threads),
                                 ERROR_FILE_ENV: os.path.join(tmp, f"error{rank}.json"), **(env or {})}
                    p = ctx.Process(
                        target=_child, args=(child_env, os.path.join(tmp, f"result{rank}.pkl"), fn, args,
                                             lifeline_r), name=f"gpipe-stage-{rank}", daemon=True)
                    p.start()
                    procs.append(p)
            lifeline_r.close()
            forwarded: list[int] = []
            with _forwarding(procs, forward_signals, forwarded):
                failure = _watch(procs, tmp, grace, job_timeout)
            if failure is not None and forwarded:
                failure.signal = forwarded[0]
        except BaseException:  # Ctrl-C or an error here: leave no stage process behind
            for p in procs:
                _kill(p)
            raise
        finally:
            lifeline_w.close()
        if failure is not None:
            if failure.signal is None:     # an interrupted job: its caller says so, in one line
                print(f"[gpipe-repro] job failed: {failure}", file=sys.stderr, flush=True)
            raise failure
        results = []
        for rank in range(nprocs):
            with open(os.path.join(tmp, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


@contextlib.contextmanager
def _sigint_held(forkserver: bool = False) -> Iterator[None]:
    """While the stage processes start: SIGINT blocked in this thread, so that the processes it
    starts (the forkserver while it imports torch, a spawned stage while it unpickles) inherit it
    blocked and a Ctrl-C does not print their tracebacks; the launcher gets it once they are
    started (and ends them), each stage takes SIGINT back when it begins (:func:`_child`). The fork
    server starts here (`forkserver`), SIGTERM ignored too (:func:`_start_forkserver_ignoring_sigterm`)."""
    held = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
    if held:
        # multiprocessing starts its resource tracker with SIGINT blocked and unblocks it after: started
        # first, it leaves the mask alone when the forkserver starts
        from multiprocessing import resource_tracker
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        if forkserver:
            _start_forkserver_ignoring_sigterm()
    try:
        yield
    finally:
        if held:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _start_forkserver_ignoring_sigterm() -> None:
    """Start multiprocessing's fork server (if this program has not yet) with SIGTERM ignored, as it
    ignores SIGINT: it stays in the launcher's process group, and a SIGTERM to the whole group (a
    job manager's, ``timeout``'s, ``kill -TERM -- -PGID``) killed it, which ended every stage it had
    forked as lost before they could finish their step and save. The launcher forwards the SIGTERM
    to the stages (:func:`_forwarding`); each stage takes SIGTERM back when it begins (:func:`_child`)."""
    from multiprocessing import forkserver
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)     # ignored survives the exec
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _child(env: dict[str, str], result_path: str, fn: Callable[..., Any], args: tuple,
           lifeline: Any = None) -> None:
    os.environ.update(env)
    os.setpgrp()    # this stage and what it starts (wandb-core) form one group, signalled together
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # the fork server it came from ignores it
    if hasattr(signal, "pthread_sigmask"):    # blocked while the launcher started it (_sigint_held):
        signal.signal(signal.SIGINT, signal.SIG_IGN)    # drop a Ctrl-C meant for the launcher,
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # then take SIGINT as usual
    if lifeline is not None:
        threading.Thread(target=_die_with_launcher, args=(lifeline,), daemon=True,
                         name="gpipe-lifeline").start()
    stage_main(_run_and_save, result_path, fn, args)


def _die_with_launcher(lifeline: Any) -> None:
    """Block on the launcher's pipe; EOF means the launcher is gone: end this stage's group now."""
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    print(f"[gpipe-repro] rank {os.environ.get('RANK', '?')}: the launcher is gone, stopping",
          file=sys.stderr, flush=True)
    os.killpg(os.getpgrp(), signal.SIGKILL)


@contextlib.contextmanager
def _forwarding(procs: list[Any], enabled: bool, forwarded: list[int]) -> Iterator[None]:
    """While the launcher watches: a SIGINT/SIGTERM it receives goes to every stage's group (and
    into `forwarded`)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: FrameType | None) -> None:
        forwarded.append(signum)
        print(f"\n[gpipe-repro] {signal.Signals(signum).name}: passed on to the {len(procs)} stage processes",
              file=sys.stderr, flush=True)
        for p in procs:
            _signal_group(p, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _signal_group(p: Any, signum: int) -> None:
    """Send `signum` to stage process `p` and everything it started (its process group)."""
    if p.pid is None:
        return
    try:
        os.killpg(p.pid, signum)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(p.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _run_and_save(result_path: str, fn: Callable[..., Any], args: tuple) -> None:
    result = fn(*args)
    tmp = f"{result_path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)   # an unpicklable result is this rank's failure, reported as such
    os.replace(tmp, result_path)


def _watch(procs: list[Any], tmp: str, grace: float, job_timeout: float | None) -> JobFailed | None:
    """Wait for every child; on the first failure end the rest. Returns the failure, if any."""
    start = time.monotonic()
    exits: dict[int, _Exit] = {}
    first_failure: float | None = None
    while len(exits) < len(procs):
        now = time.monotonic()
        deadline = None if job_timeout is None else start + job_timeout
        if first_failure is not None:
            deadline = first_failure + grace if deadline is None else min(deadline, first_failure + grace)
        if deadline is not None and now >= deadline:
            break
        live = {p.sentinel: r for r, p in enumerate(procs) if r not in exits}
        wait_s = 0.5 if deadline is None else max(0.0, min(0.5, deadline - now))
        for sentinel in multiprocessing.connection.wait(list(live), timeout=wait_s):
            rank = live[sentinel]
            procs[rank].join()
            code = procs[rank].exitcode
            exits[rank] = _Exit(rank, code, time.time(),
                                ErrorRecord.load(os.path.join(tmp, f"error{rank}.json")),
                                returned=os.path.exists(os.path.join(tmp, f"result{rank}.pkl")))
            if exits[rank].failed and first_failure is None:
                first_failure = time.monotonic()
    timed_out = [r for r in range(len(procs)) if r not in exits]
    stopped = [r for r in timed_out if _is_stopped(procs[r].pid)]   # before the kill changes it
    for r in timed_out:
        _kill(procs[r])
    failed = [e for e in exits.values() if e.failed]
    if failed:
        return _root_cause(failed, timed_out, stopped, returned=[r for r, e in exits.items() if not e.failed])
    if timed_out:
        return JobFailed(timed_out[0], f"the job did not finish within job_timeout={job_timeout} s "
                         f"(ranks {timed_out} were still running and were killed)")
    return None


def _kill(p: Any) -> None:
    """End stage process `p` and its group (SIGTERM, then SIGKILL after a second)."""
    _signal_group(p, signal.SIGTERM)
    p.join(1.0)
    if p.is_alive():
        _signal_group(p, signal.SIGKILL)
        p.join(1.0)
    elif p.pid is not None:
        try:   # what the stage started (wandb-core) must not outlive it
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _is_stopped(pid: int | None) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, SIGTSTP, a debugger): state T or t in
    /proc/<pid>/stat (Linux, proc(5)); False where that cannot be read."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, so split after the last ')'
    fields = stat[stat.rfind(")") + 1:].split()
    return bool(fields) and fields[0] in ("T", "t")


def _cause(e: _Exit) -> str:
    if e.record is not None:
        return e.record.message
    if e.code < 0:
        try:
            name = signal.Signals(-e.code).name
        except ValueError:
            name = str(-e.code)
        return f"killed by signal {name} (exit code {e.code})"
    if e.code == 0:
        return ("exited with code 0 before its function returned (sys.exit() or os._exit(0) in it): a "
                "stage ends by returning from its function, as every rank does, or by raising")
    return f"exited with code {e.code} without reporting an error"


def _root_cause(failed: list[_Exit], killed: list[int], stopped: list[int] | None = None,
                returned: list[int] | None = None) -> JobFailed:
    """The failure where it started. In order:

    1. an error or a kill beats a lost peer (the earliest of them);
    2. when every dead rank only lost a peer (a communication timeout), a rank that was found
       stopped (SIGSTOP: alive but frozen) when the job was ended;
    3. otherwise the end of the chain of lost peers: rank a timed out waiting for b, b (if it
       reported) for c, ... up to a rank that reported nothing (alive but stuck, then killed);
    4. where the waits name no peer (a collective: AGREE's all-reduce, joining the job), the rank
       that was still running when every other had failed (the lowest, if several).

    Why not simply the peer named by the earliest timeout: with
    three or more stages the frozen rank's neighbour waits on it, and the next rank waits on that
    neighbour; whichever began waiting first times out first, so the earliest timeout can name a
    rank that was only waiting itself, and the grace period can end before that rank's own timeout
    reports the frozen one. Rules 2 and 3 do not depend on that order.
    """
    def primary(e: _Exit) -> bool:
        return e.record is None or e.record.kind != "peer"

    candidates = [e for e in failed if primary(e)]
    if candidates:
        first = min(candidates, key=lambda e: e.record.time if e.record else e.seen)
    else:
        first = min(failed, key=lambda e: e.record.time if e.record else e.seen)
        lost = "; ".join(f"rank {e.rank}: {_cause(e).splitlines()[0]}"
                         for e in sorted(failed, key=lambda e: e.rank))
        if stopped:
            return JobFailed(min(stopped), "stopped answering: the process was stopped (a SIGSTOP or "
                             "a debugger) and its neighbours timed out waiting for it",
                             f"other ranks: {lost}")
        waits_for = {e.rank: e.record.peer for e in failed
                     if e.record is not None and e.record.peer is not None}
        peer = waits_for.get(first.rank)
        seen = {first.rank}
        while peer is not None and peer in waits_for and peer not in seen:
            seen.add(peer)
            peer = waits_for[peer]
        if peer is not None and peer in (returned or []):
            return JobFailed(first.rank, f"waited for rank {peer}, whose function had already returned: "
                             "the ranks made different calls (one more train_step or forward, or "
                             "a gather_layers while another still stepped); every rank must make "
                             "the same calls in the same order", f"other ranks: {lost}")
        if peer is not None and all(p.rank != peer for p in failed):
            return JobFailed(peer, "stopped answering (its neighbours timed out waiting for it)",
                             f"other ranks: {lost}")
        if killed:    # waits in a collective (AGREE, joining the job) name no peer: the rank that
            # was still running when every other had failed waiting is the one they waited for
            stuck = ", ".join(map(str, killed))
            return JobFailed(min(killed), f"stopped answering: still running (rank{'s' * (len(killed) > 1)} "
                             f"{stuck}) when every other rank had failed waiting for it",
                             f"other ranks: {lost}")
    others = [f"rank {e.rank}: {_cause(e).splitlines()[0]}" for e in sorted(failed, key=lambda e: e.rank)
              if e is not first]
    others += [f"rank {r}: still running after the failure, killed" for r in killed]
    return JobFailed(first.rank, _cause(first), ("other ranks: " + "; ".join(others)) if others else "")
