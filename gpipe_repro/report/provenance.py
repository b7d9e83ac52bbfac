"""Where a number was measured: software versions, hardware, code version, time.

Why: a throughput or a loss is meaningless without the machine and the code that produced it. Every
results JSON embeds `environment()` (see `gpipe_repro/report/records.py`), so a table can always be traced
back to a torch version, a device, a core count and a git commit, and a number from a dirty working
tree is marked as such.

It is cheap on purpose: it never imports torch (it reads the version from the installed package
metadata, and asks torch for threads / CUDA only when the caller has already imported it), reads
/proc/cpuinfo directly, and asks git once per process (the code a process runs does not change while
it runs, so the answer is cached).
"""
from __future__ import annotations

import datetime as _dt
import functools
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

# The repository this package lives in (an editable install); git is asked about this directory.
_REPO_ROOT = Path(__file__).resolve().parents[2]  # gpipe_repro/report/provenance.py -> repo


def environment() -> dict[str, Any]:
    """A JSON-ready description of this process's software, hardware and code version."""
    torch = sys.modules.get("torch")  # only if the caller already paid for the import
    cuda = _cuda_info(torch)
    return {
        "torch": _package_version("torch"),
        "numpy": _package_version("numpy"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "device": cuda["device"] if cuda else cpu_model(),
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "cuda": cuda,
        "memory_gb": _memory_gb(),
        **git_state(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


@functools.cache
def host_block(*, idle_fraction_before: float | None = None) -> dict[str, Any]:
    """A results file's top-level ``"host"``: where a measurement ran and how busy the host was.

    Usable cores, CPU model, hostname, the 1/5/15-minute load averages now, the idle fraction of
    the CPU measured just before (``report.host.host_idle_fraction``, if the caller took it), and
    the code (git commit, dirty tree). Call it when the measurement starts; record the load again
    when it ends if the run is long."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"usable_cores": cores, "cpu": cpu_model(), "hostname": socket.gethostname(),
            "load_average": list(os.getloadavg()), "idle_fraction_before": idle_fraction_before,
            **git_state(),
            "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def git_state() -> dict[str, Any]:
    """`{"git_commit": sha or None, "git_dirty": bool or None}` for the repository of this package.

    Dirty means tracked files outside results/ differ from the commit (see :func:`changed_files`).
    """
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    changed = changed_files()
    return {"git_commit": commit, "git_dirty": None if changed is None else bool(changed)}


def changed_files(repo: str | os.PathLike[str] | None = None) -> list[str] | None:
    """Tracked files of `repo` (default: this package's) that differ from its commit, outside the
    results of record (results/); None where git cannot say.

    Untracked files (checkpoints, scratch) do not count, nor do results/ files: a run that writes
    results would otherwise mark the next one dirty, and a regeneration of every result (`make
    results`) would mark its own later parts dirty."""
    names = _git("diff", "--name-only", "HEAD", "--", ".", ":(exclude)results", repo=repo)
    return None if names is None else [line for line in names.splitlines() if line]


def _git(*args: str, repo: str | os.PathLike[str] | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo or _REPO_ROOT), *args], capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _package_version(name: str) -> str | None:
    module = sys.modules.get(name)
    if module is not None and hasattr(module, "__version__"):
        return str(module.__version__)
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_info(torch: Any) -> dict[str, Any] | None:
    if torch is None or not torch.cuda.is_available():
        return None
    return {
        "device": torch.cuda.get_device_name(torch.cuda.current_device()),
        "device_count": torch.cuda.device_count(),
        "cuda_version": torch.version.cuda,
    }


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)  # kB -> GiB
    except (OSError, ValueError, IndexError):
        pass
    return None
