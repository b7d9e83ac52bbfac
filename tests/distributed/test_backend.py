"""Which backend a stage process chooses, on hosts with no, too few and enough GPUs.

Seen on a one-GPU H100 host (2026-11-23): every two-stage job died with 'CUDA error: invalid device
ordinal' on rank 1, because the default chose NCCL and cuda:LOCAL_RANK whenever CUDA was available.
"""
from __future__ import annotations

import pytest
import torch

from gpipe_repro.distributed import process_group
from gpipe_repro.distributed.launch_env import BACKEND_ENV


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):
    def make(gpus: int, local_world: int, local_rank: int = 0) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    return make


def test_no_gpu_chooses_gloo_quietly(host, recwarn) -> None:
    host(0, 2)
    assert process_group.choose_backend() == "gloo"
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("gpus, local", [(1, 1), (2, 2), (8, 4)])
def test_one_gpu_per_local_process_chooses_nccl(host, gpus: int, local: int) -> None:
    host(gpus, local)
    assert process_group.choose_backend() == "nccl"


def test_too_few_gpus_fall_back_to_gloo_and_say_why(host) -> None:
    host(1, 2)
    with pytest.warns(RuntimeWarning, match=rf"2 stage processes on this host but 1 GPU.*{BACKEND_ENV}=gloo"):
        assert process_group.choose_backend() == "gloo"


def test_only_local_rank_zero_warns(host, recwarn) -> None:
    host(1, 2, local_rank=1)
    assert process_group.choose_backend() == "gloo"
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("gpus, local, rank, match", [
    (1, 2, 0, r"needs one GPU per stage process: this host runs 2 process\(es\) and sees 1 GPU"),
    (1, 2, 1, r"needs one GPU per stage process"),
    (0, 1, 0, r"needs a GPU, and this process sees none"),
])
def test_explicit_nccl_with_too_few_gpus_fails_on_every_rank_before_joining(
        host, monkeypatch: pytest.MonkeyPatch, gpus: int, local: int, rank: int, match: str) -> None:
    host(gpus, local, rank)
    for var, value in (("RANK", str(rank)), ("WORLD_SIZE", str(local)), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "1")):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv(BACKEND_ENV, "nccl")
    joined = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: joined.append(a))
    with pytest.raises(RuntimeError, match=match):
        process_group.init_distributed()
    assert not joined


def test_unknown_backend_names_where_it_came_from(host, monkeypatch: pytest.MonkeyPatch) -> None:
    host(0, 1)
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "1")):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv(BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match=rf"'gloo' or 'nccl', got 'mpi'.*{BACKEND_ENV}"):
        process_group.init_distributed()
