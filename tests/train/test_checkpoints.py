"""Checkpoints: atomic, keep-last-N, RNG capture/restore, exact resume of a training loop, Ctrl-C."""
from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gpipe_repro.data.augment import Augmentation
from gpipe_repro.data.images import BatchIterator, ImageDataset
from gpipe_repro.train.checkpoints import (
    capture_rng_state,
    checkpoint_path,
    graceful_interrupt,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    restore_training_state,
    save_checkpoint,
    training_state,
)


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.normal()), torch.randn(4).tolist()


class Unpicklable:
    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("this object cannot be pickled")


def test_keep_last_n_and_latest(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None and latest_checkpoint(tmp_path / "missing") is None
    for step in (1, 10, 2, 100, 20):
        save_checkpoint(checkpoint_path(tmp_path, step), {"step": step}, keep_last=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000010.pt", "step-00000020.pt",
                                                            "step-00000100.pt"]
    latest = latest_checkpoint(tmp_path)
    assert latest == tmp_path / "step-00000100.pt"
    assert load_checkpoint(latest)["step"] == 100
    save_checkpoint(checkpoint_path(tmp_path, 200), {"step": 200}, keep_last=None)
    assert len(list_checkpoints(tmp_path)) == 4
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "step-00000001.pt")


def test_failed_save_keeps_the_previous_latest(tmp_path: Path) -> None:
    save_checkpoint(checkpoint_path(tmp_path, 1), {"w": torch.ones(3)})
    with pytest.raises(RuntimeError, match="cannot be pickled"):  # torch.save fails midway
        save_checkpoint(checkpoint_path(tmp_path, 2), {"w": torch.zeros(1000), "bad": Unpicklable()})
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001.pt"]
    assert torch.equal(load_checkpoint(latest_checkpoint(tmp_path))["w"], torch.ones(3))


def test_rng_capture_restore_reproduces_draws_through_a_file(tmp_path: Path) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.normal()  # leave a cached Gaussian in numpy's state
    state = capture_rng_state()
    expected = draws()
    save_checkpoint(tmp_path / "rng.pt", {"rng": state})
    draws()  # move every stream on
    restore_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])  # weights_only load
    assert draws() == expected


def tiny_dataset() -> ImageDataset:
    g = torch.Generator().manual_seed(0)
    return ImageDataset(name="tiny", split="train", pixels=torch.randint(0, 256, (40, 1, 6, 6), generator=g,
                                                                         dtype=torch.uint8),
                        labels=torch.randint(0, 3, (40,), generator=g), class_names=("a", "b", "c"),
                        mean=(0.5,), std=(0.3,))


class Run:
    """A small but complete training loop state: model with dropout, momentum, scheduler, data, aug."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.data = tiny_dataset()
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU(), nn.Dropout(0.3),
                                   nn.Linear(16, 3))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        self.batches = BatchIterator(self.data, 8, seed=5)  # 5 batches per epoch: steps cross epochs
        self.augment = Augmentation(crop_padding=1, flip=True, cutout_size=2, seed=7)
        self.stateful = {"model": self.model, "optimizer": self.opt, "scheduler": self.sched,
                         "data": self.batches, "augment": self.augment}

    def step(self) -> float:
        x, y = next(self.batches)
        x = self.data.normalize(self.augment(x))
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        return loss.item()


def test_resumed_run_continues_bit_for_bit(tmp_path: Path) -> None:
    reference = Run()
    for _ in range(4):
        reference.step()
    save_checkpoint(checkpoint_path(tmp_path, 4), training_state(4, reference.stateful))
    expected = [reference.step() for _ in range(4)]

    resumed = Run()  # fresh objects, as after a restart
    torch.manual_seed(12345)  # a different global stream, which the checkpoint must override
    step = restore_training_state(load_checkpoint(latest_checkpoint(tmp_path)), resumed.stateful)
    assert step == 4 and resumed.batches.position == (0, 4)
    assert [resumed.step() for _ in range(4)] == expected
    pairs = zip(reference.model.parameters(), resumed.model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_restore_refuses_missing_state(tmp_path: Path) -> None:
    run = Run()
    ckpt = training_state(0, {"model": run.model})
    with pytest.raises(KeyError, match="optimizer"):
        restore_training_state(ckpt, {"model": run.model, "optimizer": run.opt})
    gen = torch.Generator().manual_seed(3)
    ckpt = training_state(0, {}, generators={"g": gen})
    expected = torch.rand(3, generator=gen)
    restore_training_state(ckpt, {}, generators={"g": gen})
    assert torch.equal(torch.rand(3, generator=gen), expected)


def test_graceful_interrupt_first_sets_flag_second_aborts() -> None:
    before = signal.getsignal(signal.SIGINT)
    with graceful_interrupt() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.signal == signal.SIGINT and bool(stop)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    with graceful_interrupt(signals=(signal.SIGTERM,)) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == signal.SIGTERM


def test_resuming_with_other_replicas_is_refused_and_old_checkpoints_mean_one() -> None:
    """R replicas of M micro-batches are R x M micro-batches: a different --replicas changes the run.
    A checkpoint written before --replicas existed (no key) counts as one pipeline."""
    from types import SimpleNamespace

    from gpipe_repro.train.checkpoints import check_resumable
    from gpipe_repro.train.config import RunConfig

    task: Any = SimpleNamespace(config=lambda: {})
    saved = RunConfig(steps=4, runtime="distributed").to_dict()
    old = {k: v for k, v in saved.items() if k != "replicas"}
    assert check_resumable({"run": old, "task": {}}, RunConfig(steps=4), task) == []
    with pytest.raises(ValueError, match="replicas: saved 1, now 2"):
        check_resumable({"run": saved, "task": {}}, RunConfig(steps=4, runtime="distributed", replicas=2),
                        task)


def test_a_refused_resume_names_the_run_directory_and_what_not_given_means(tmp_path: Path) -> None:
    """`--resume` without `--out` takes the newest runs/<name>[-N]; its refusal did not say which run
    it had tried, nor that an option given now with the default's value differs from one not given."""
    from types import SimpleNamespace

    from gpipe_repro.train.checkpoints import check_resumable
    from gpipe_repro.train.config import RunConfig

    task: Any = SimpleNamespace(config=lambda: {})
    where = str(tmp_path / "run-2")
    saved = RunConfig(steps=4, out_dir=where).to_dict()
    with pytest.raises(ValueError) as refused:
        check_resumable({"run": saved, "task": {}}, RunConfig(steps=4, out_dir=where, lr=0.1), task)
    said = " ".join(str(refused.value).split())
    assert f"cannot resume {tmp_path / 'run-2'}" in said
    assert "lr: saved not given (the task's default), now 0.1" in said
    assert "leave it out, even where you give the default's value" in said
    assert "give its directory with --out" in said
