"""Stage processes keep freed memory: a training step stops page-faulting its activations in again.

Counted, not timed: minor page faults per step of a small conv net (micro-batches of 128 rows, 2 MB
activations) in a fresh process, glibc's defaults against :func:`keep_freed_memory`, and in a stage
process started by the launcher (which joins the job through ``init_distributed``) with the setting
on and off.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from gpipe_repro.engine import cpu_allocator

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

STEP_FAULTS = """
import resource, sys, torch
from torch import nn
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    from gpipe_repro.engine.cpu_allocator import keep_freed_memory
    assert keep_freed_memory()
m = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()) for _ in range(3)])
x = torch.randn(256, 8, 16, 16)
def step():
    for xs in x.chunk(2):
        m(xs).sum().backward()
for _ in range(2):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def step_faults() -> int:
    """In a stage process: join the job, then count the minor page faults of three steady-state
    training steps."""
    import resource

    import torch
    from torch import nn

    from gpipe_repro.distributed import init_distributed
    init_distributed()
    m = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()) for _ in range(3)])
    x = torch.randn(256, 8, 16, 16)
    for i in range(5):
        if i == 2:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for xs in x.chunk(2):
            m(xs).sum().backward()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _faults(mode: str, **env: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEP_FAULTS, mode], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True)
    return int(out.stdout.split()[-1])


def test_kept_memory_stops_the_page_faults_of_every_step() -> None:
    default, kept = _faults("default"), _faults("keep")
    assert kept * 5 < default, (default, kept)


def test_stage_processes_keep_freed_memory_unless_turned_off() -> None:
    from gpipe_repro.distributed import launch_local
    on = launch_local(step_faults, 1, timeout=30)[0]
    off = launch_local(step_faults, 1, timeout=30, env={cpu_allocator.ENV: "0"})[0]
    assert on * 5 < off, (on, off)


def test_the_switch_is_checked_and_says_what_to_write(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_allocator.ENV, "0")
    assert not cpu_allocator.enabled() and "defaults" in cpu_allocator.describe()
    monkeypatch.setenv(cpu_allocator.ENV, "maybe")
    with pytest.raises(ValueError, match="use 1 .* or 0"):
        cpu_allocator.enabled()
    monkeypatch.delenv(cpu_allocator.ENV)
    assert cpu_allocator.enabled() and "keeps freed memory" in cpu_allocator.describe()
