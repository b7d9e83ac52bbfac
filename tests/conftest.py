"""Suite-wide settings: one torch thread.

The suite runs on 2 cores, often beside other work; tiny-op models run many times slower with two
threads fighting over them. Tests that measure parallel speed spawn their own processes and pin
their own thread counts.

Distributed jobs run over gloo on the CPU, whatever GPUs the host has: the suite checks the engine's
semantics against CPU references (a one-GPU host would otherwise fall back with a warning, and a
multi-GPU one would run NCCL with TF32 convolutions). `make gpu-check` is where GPUs are tested.
"""
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.curves import curves_not_drawn

os.environ.setdefault("GPIPE_REPRO_BACKEND", "gloo")

torch.set_num_threads(1)


# The files that take longest (each several stage processes, CLI subprocesses or a whole toy run),
# longest first. `make test` runs whole files per worker (--dist loadfile) and hands them out in
# collection order, so starting these first lets the two workers finish together instead of one
# worker starting a two-minute file when the other has nothing left to do.
SLOW_FILES_FIRST = (
    "repro/test_gpu_check.py",
    "distributed/test_faults.py",
    "train/test_translation.py",
    "train/test_loop.py",
    "memory/test_planner.py",
    "train/test_resume.py",
    "distributed/test_multinode.py",
    "distributed/test_replicas.py",
    "sim/test_calibration.py",
    "distributed/test_torchrun.py",
    "train/test_checkpoints.py",
    "commands/test_run.py",
    "distributed/test_equivalence.py",
    "distributed/test_steps.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow files first (in SLOW_FILES_FIRST's order), every other file after them as collected;
    the order of the tests inside a file is kept."""
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}

    def key(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return rank.get(path, len(rank))

    items.sort(key=key)      # stable: files keep their collection order within each rank


@pytest.fixture
def undrawn_curves() -> Iterator[list[Path]]:
    """The test's training runs write curves.png without drawing it (tests/curves.py)."""
    with curves_not_drawn() as written:
        yield written
