"""How a training run joins a distributed job."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gpipe_repro.train.config import RunConfig
from gpipe_repro.train.ranks import join


def test_hang_a_torchrun_run_waited_600_s_for_a_silent_peer_whatever_its_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun, `run --timeout 10` joined the process group with the 600 s default (only
    launch_local passed --timeout on, through the environment): a stopped rank held the job for ten
    minutes, Ctrl-C included. The run's timeout now reaches the process group itself."""
    from gpipe_repro.distributed import process_group

    joined: list[dict[str, Any]] = []

    def init_distributed(**kwargs: Any) -> SimpleNamespace:
        joined.append(kwargs)
        return SimpleNamespace(rank=1)
    monkeypatch.setattr(process_group, "init_distributed", init_distributed)
    assert join(RunConfig(steps=1, runtime="distributed", timeout=10.0, threads=2)) == 1
    assert joined == [{"timeout_s": 10.0, "threads": 2}]
    assert join(RunConfig(steps=1, runtime="local")) is None and len(joined) == 1
