"""The run loop (gpipe_repro/train/loop.py) with the AmoebaNet task: K-invariance of training,
what a run writes (metrics, W&B offline run, summary, curves), offline data, clear errors, transfer."""
from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gpipe_repro.cli import app
from gpipe_repro.data.images import DatasetUnavailableError
from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.paper import AMOEBANET_RECIPE, IMAGENET
from gpipe_repro.report.wandb_log import read_metrics
from gpipe_repro.train.checkpoints import checkpoint_path, load_checkpoint, save_checkpoint, training_state
from gpipe_repro.train.config import RunConfig
from gpipe_repro.train.loop import PipelineState, train
from gpipe_repro.train.ranks import launch
from gpipe_repro.train.tasks.image_classification import AmoebaNetConfig, AmoebaNetTask, preset
from gpipe_repro.train.tasks.transfer import (
    TransferConfig,
    classifier_prefixes,
    layer_state_dict,
    load_pretrained,
    transfer_runs,
    write_transfer_report,
)
from tests.curves import curves_not_drawn


def tiny(out: Path, **run_changes: Any) -> tuple[RunConfig, AmoebaNetConfig]:
    """AmoebaNet-B (3, 8) on 8x8 digits with dropout, drop-path (from step 0), aux head, augmentation."""
    run, task = preset("smoke")
    run = dataclasses.replace(run, out_dir=str(out), batch_size=16, micro_batches=4, steps=4,
                              eval_every=2, save_every=0, timeline_every=2, wandb="disabled",
                              progress=False, threads=1)
    run = dataclasses.replace(run, **run_changes)
    return run, dataclasses.replace(task, dropout=0.5, drop_path=0.3, drop_path_ramp=False)


# ----------------------------------------------------------------------------- the same training for any K

@pytest.mark.usefixtures("undrawn_curves")     # curves.png not drawn (tests/curves.py)
def test_k1_and_k4_give_the_same_loss_curve_and_weights(tmp_path: Path) -> None:
    results = {}
    for k in (1, 4):
        run, task = tiny(tmp_path / f"k{k}", partitions=k)
        summary = train(AmoebaNetTask(task), run)
        assert summary.status == "finished" and len(summary.balance) == k
        results[k] = summary, load_checkpoint(checkpoint_path(tmp_path / f"k{k}" / "checkpoints", 4))
    (s1, c1), (s4, c4) = results[1], results[4]
    assert len(s1.losses) == 4 and len(set(s1.losses)) == 4      # a real curve, not a constant
    torch.testing.assert_close(torch.tensor(s4.losses), torch.tensor(s1.losses), rtol=1e-5, atol=1e-6)
    names = list(AmoebaNetTask(tiny(tmp_path)[1]).build_layers()._modules)
    weights1, weights4 = layer_state_dict(c1, names), layer_state_dict(c4, names)
    assert weights1.keys() == weights4.keys()
    for key in weights1:
        torch.testing.assert_close(weights4[key], weights1[key], rtol=1e-4, atol=1e-5)
    assert s1.eval["top1"] == pytest.approx(s4.eval["top1"])


# ----------------------------------------------------------------------------- the distributed runtime

@pytest.mark.usefixtures("undrawn_curves")     # curves.png not drawn (tests/curves.py)
def test_distributed_run_trains_like_the_local_one_and_its_checkpoints_resume_locally(tmp_path: Path) -> None:
    local_run, task = tiny(tmp_path / "local", partitions=2, save_every=2)
    local = train(AmoebaNetTask(task), local_run)
    dist_run = dataclasses.replace(local_run, out_dir=str(tmp_path / "dist"), runtime="distributed")
    distributed = launch(functools.partial(AmoebaNetTask, task), dist_run)    # 2 stage processes
    torch.testing.assert_close(torch.tensor(distributed.losses), torch.tensor(local.losses),
                               rtol=1e-6, atol=1e-7)
    assert distributed.eval == pytest.approx(local.eval)
    assert any(k.startswith("memory/rank1_") for k in distributed.memory)
    # rank 0 wrote one checkpoint holding both cells, in the local runtime's format
    ours = load_checkpoint(checkpoint_path(tmp_path / "dist" / "checkpoints", 4))["state"]["pipeline"]
    theirs = load_checkpoint(checkpoint_path(tmp_path / "local" / "checkpoints", 4))["state"]["pipeline"]
    assert ours["model"].keys() == theirs["model"].keys() and len(ours["optimizers"]) == 2
    for key, value in theirs["model"].items():
        torch.testing.assert_close(ours["model"][key], value, rtol=1e-5, atol=1e-6)
    # ... so a local run can resume it from step 2
    (tmp_path / "dist" / "summary.json").unlink()
    checkpoint_path(tmp_path / "dist" / "checkpoints", 4).unlink()
    resumed = train(AmoebaNetTask(task), dataclasses.replace(local_run, out_dir=str(tmp_path / "dist"),
                                                             resume=True))
    assert resumed.resumed_from == 2
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(local.losses[2:]),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.slow   # four stage processes
@pytest.mark.usefixtures("undrawn_curves")     # curves.png not drawn (tests/curves.py)
def test_replicas_train_like_one_pipeline_of_all_their_micro_batches(tmp_path: Path) -> None:
    """K=2 x R=2 (4 processes, M=2 each) takes the same steps as one local pipeline with
    the R x M = 4 micro-batches (replica r runs micro-batches r*M ..); rank 0 alone writes: one
    metrics row per step, one checkpoint in the local format with every cell."""
    local_run, task = tiny(tmp_path / "local", partitions=2, micro_batches=4, steps=2, eval_every=0)
    local = train(AmoebaNetTask(task), local_run)
    run = dataclasses.replace(local_run, out_dir=str(tmp_path / "dist"), runtime="distributed",
                              replicas=2, micro_batches=2)
    distributed = launch(functools.partial(AmoebaNetTask, task), run)
    torch.testing.assert_close(torch.tensor(distributed.losses), torch.tensor(local.losses),
                               rtol=1e-5, atol=1e-6)
    assert any(k.startswith("memory/rank3_") for k in distributed.memory)
    rows = read_metrics(tmp_path / "dist" / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    ours = load_checkpoint(checkpoint_path(tmp_path / "dist" / "checkpoints", 2))["state"]["pipeline"]
    theirs = load_checkpoint(checkpoint_path(tmp_path / "local" / "checkpoints", 2))["state"]["pipeline"]
    assert ours["model"].keys() == theirs["model"].keys() and len(ours["optimizers"]) == 2
    for key, value in theirs["model"].items():
        if "running_" not in key:     # BatchNorm running statistics are per replica (replica 0's kept)
            torch.testing.assert_close(ours["model"][key], value, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- what a run writes

def test_a_run_writes_metrics_wandb_offline_summary_and_curves(tmp_path: Path) -> None:
    run, task = tiny(tmp_path, wandb="offline", partitions=2)
    summary = train(AmoebaNetTask(task), run)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]       # steps completed (loop.py: STEP NUMBERS)
    assert all(r["train/samples_per_s"] > 0 and r["train/lr"] > 0 for r in train_rows)
    sampled = [r for r in rows if "pipeline/stage0_busy" in r]
    assert [r["step"] for r in sampled] == [1, 3]               # every timeline_every steps only
    for r in sampled:
        for s in (0, 1):
            assert 0 < r[f"pipeline/stage{s}_busy"] <= 1
            assert r[f"pipeline/stage{s}_idle"] == pytest.approx(1 - r[f"pipeline/stage{s}_busy"], abs=1e-3)
        assert r["memory/cpu_peak_rss_mb"] > 0 and r["memory/cell0_state_mb"] > 0
        assert r["pipeline/bubble"] >= 0
    evals = [r for r in rows if "eval/top1" in r]
    assert [r["step"] for r in evals] == [2, 4]                 # eval_every=2: after 2 and 4 steps
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt"))[-1] == "step-00000004.pt"
    assert 0 <= evals[-1]["eval/top1"] <= evals[-1]["eval/top5"] <= 100

    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["status"] == "finished" and written["steps"] == 4
    assert written["metrics"]["eval_top1"] == {"value": summary.eval["top1"], "method": "measured"}
    assert written["environment"]["torch"] and written["config"]["run"]["partitions"] == 2
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert (tmp_path / "summary.md").read_text().startswith("# ")
    run_json = json.loads((tmp_path / "run.json").read_text())
    assert run_json["mode"] == "offline" and run_json["status"] == "finished"
    assert run_json["images"]["curves"] and run_json["summary"]["eval/top1"] == summary.eval["top1"]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))

    # a finished run is replaced by a new one in the same directory only when asked (--overwrite,
    # or --record: make train-amoebanet twice)
    with pytest.raises(FileExistsError, match="Pass --overwrite to replace it"):
        train(AmoebaNetTask(task), dataclasses.replace(run, wandb="disabled", steps=2, eval_every=0))
    with curves_not_drawn():           # this run's picture is not looked at (tests/curves.py)
        again = train(AmoebaNetTask(task), dataclasses.replace(run, wandb="disabled", steps=2, eval_every=0,
                                                                overwrite=True))
    assert again.steps == 2
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r] == [1, 2]


# ----------------------------------------------------------------------------- offline and errors

@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record (and refuse) every connection to a non-loopback address."""
    attempts: list[Any] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def is_local(host: Any) -> bool:
        if not isinstance(host, str) or host in ("localhost", ""):
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def connect(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not is_local(address[0]):
            attempts.append(address)
            raise ConnectionRefusedError(f"network disabled by the test: {address}")
        return real_connect(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_local(host):
            attempts.append(host)
            raise socket.gaierror(f"network disabled by the test: {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


@pytest.mark.usefixtures("undrawn_curves")     # curves.png not drawn (tests/curves.py)
def test_offline_datasets_train_without_touching_the_network(tmp_path: Path, no_network: list[Any]) -> None:
    run, task = tiny(tmp_path, steps=1, eval_every=0, timeline_every=0)
    for dataset in ("digits", "mnist-sample"):
        summary = train(AmoebaNetTask(dataclasses.replace(task, dataset=dataset)),
                        dataclasses.replace(run, out_dir=str(tmp_path / dataset)))
        assert summary.status == "finished"
    assert no_network == []


def test_hub_dataset_offline_fails_naming_the_offline_alternatives(
        tmp_path: Path, no_network: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))           # an empty cache
    with pytest.raises(DatasetUnavailableError, match="mnist-sample.*digits"):
        AmoebaNetTask(AmoebaNetConfig(dataset="cifar10"))
    result = CliRunner().invoke(app, ["run", "amoebanet", "--dataset", "cifar10", "--out",
                                      str(tmp_path / "run"), "--wandb", "disabled"])
    assert result.exit_code == 2
    assert "mnist-sample" in result.output and "digits" in result.output
    assert no_network == []


def test_bad_settings_fail_with_what_to_change(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="raise --batch-size or lower --m"):
        RunConfig(steps=1, batch_size=8, micro_batches=16)
    with pytest.raises(ValueError, match="steps or epochs"):
        RunConfig()
    with pytest.raises(ValueError, match="interleaved with the local runtime here"):
        RunConfig(steps=1, schedule="interleaved", runtime="distributed")
    run, task = tiny(tmp_path, runtime="distributed", launcher="torchrun")
    with pytest.raises(RuntimeError, match="start the job with torchrun"):
        launch(functools.partial(AmoebaNetTask, task), run)
    result = CliRunner().invoke(app, ["run", "amoebanet", "--preset", "nope"])
    assert result.exit_code == 2 and "cpu, paper, smoke" in result.output


def test_paper_preset_is_the_papers_table_4_setup() -> None:
    run, task = preset("paper")
    assert (f"AmoebaNet-{task.genotype} ({task.L}, {task.F})", task.image_size, run.partitions) == \
        (IMAGENET["model"], IMAGENET["image_size"], IMAGENET["partitions"])
    assert run.micro_batches == 32 and run.device == "cuda"
    assert task.label_smoothing == AMOEBANET_RECIPE["label_smoothing"]
    assert task.bn_momentum == pytest.approx(1 - AMOEBANET_RECIPE["bn_decay"])
    cpu_run, cpu_task = preset("cpu")
    assert cpu_task.dataset == "mnist-sample" and cpu_run.partitions == 4


# ----------------------------------------------------------------------------- transfer

def test_pretrained_weights_load_across_partitionings_with_a_new_classifier(tmp_path: Path) -> None:
    task = AmoebaNetTask(tiny(tmp_path)[1])
    torch.manual_seed(1)
    pipe = GPipe(task.build_layers(), partitions=3, micro_batches=2,
                 optimizer=lambda p: torch.optim.SGD(p, 0.1))
    save_checkpoint(checkpoint_path(tmp_path, 5), training_state(5, {"pipeline": PipelineState(pipe)},
                                                                 extra={"task": task.config()}))
    torch.manual_seed(2)
    fresh = task.build_layers()
    pretrained = {f"{name}.{key}": value for name, layer in zip(fresh._modules, pipe.unpartitioned())
                  for key, value in layer.state_dict().items()}
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    classifiers = load_pretrained(fresh, tmp_path)
    assert classifiers == classifier_prefixes(fresh) and "head.fc" in classifiers and len(classifiers) == 2
    for key, value in fresh.state_dict().items():
        if any(key.startswith(c + ".") for c in classifiers):
            assert torch.equal(value, before[key]), key           # left as newly initialized
        else:
            assert torch.equal(value, pretrained[key]), key       # transferred
    wider = AmoebaNetTask(dataclasses.replace(tiny(tmp_path)[1], F=12))
    with pytest.raises(ValueError, match="same architecture"):
        load_pretrained(wider.build_layers(), tmp_path)


@pytest.mark.usefixtures("undrawn_curves")     # curves.png not drawn (tests/curves.py)
def test_transfer_protocol_reports_mean_over_seeds_beside_the_paper(tmp_path: Path) -> None:
    run, task = tiny(tmp_path / "pre", steps=2, eval_every=0, timeline_every=0)
    train(AmoebaNetTask(task), run)
    config = TransferConfig(source=str(tmp_path / "pre"), dataset="digits", seeds=(0, 1), steps=2,
                            batch_size=16, partitions=2, micro_batches=2, baseline=False,
                            out_dir=str(tmp_path / "transfer"), wandb="disabled", progress=False)
    results = transfer_runs(config)
    seeds = results["runs"]["pretrained"]["seeds"]
    assert [s["seed"] for s in seeds] == [0, 1]
    assert results["runs"]["pretrained"]["mean_top1"] == pytest.approx(sum(s["top1"] for s in seeds) / 2)
    json_path, md_path = write_transfer_report(results, config)
    payload = json.loads(json_path.read_text())
    assert payload["paper"]["transfer_top1"]["cifar10"] == 99.0
    assert payload["results"]["pretrained"]["mean_top1"]["method"] == "measured"
    assert "not comparable" in payload["note"] and "cifar10 (paper)" in md_path.read_text()


def test_a_diverging_run_stops_with_one_line_and_never_saves_a_non_finite_checkpoint(tmp_path: Path) -> None:
    """--lr 1e6: the BatchNorm running variances overflow before the loss does. The save that would
    have written them refuses (a checkpoint nobody can resume from), names a tensor, and the step
    numbers in messages are the records' (1-based)."""
    from gpipe_repro.train.checkpoints import list_checkpoints
    run, task = tiny(tmp_path / "run", lr=1e6, steps=30, save_every=1, eval_every=0, timeline_every=0)
    with pytest.raises(FloatingPointError, match=r"the training diverged: (after step \d+|the loss is)"):
        train(AmoebaNetTask(task), run)
    for path in list_checkpoints(tmp_path / "run" / "checkpoints"):
        state = load_checkpoint(path)["state"]
        tensors = [t for t in _all_tensors(state) if t.is_floating_point()]
        assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors), path
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        dataclasses.replace(run, lr=float("nan"))


def _all_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _all_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _all_tensors(v)]
    return []


def test_without_a_terminal_progress_is_a_plain_line_now_and_then(capsys: pytest.CaptureFixture[str]) -> None:
    """Under nohup, CI or --no-progress a live bar prints nothing until the end: the stand-in prints
    step, loss, rate and ETA at most every `every_s` seconds (a 19-minute run was silent)."""
    import time

    from gpipe_repro.train.console import NoProgress, progress_bar
    assert isinstance(progress_bar(True), NoProgress)          # pytest's stdout is not a terminal
    bar = NoProgress(quiet=False, every_s=0.01)
    task = bar.add_task("run", total=10, completed=0)
    bar.update(task, completed=1, loss=2.5, rate=100.0)        # too soon: nothing
    time.sleep(0.02)
    bar.update(task, completed=2, loss=2.25, rate=120.0)
    out = capsys.readouterr().out
    assert "step 2/10 loss 2.2500 120.0 samples/s elapsed 0:00:00 eta 0:00:00" in out
    assert "step 1/10" not in out
    silent = NoProgress(quiet=True, every_s=0.01)
    silent.add_task("run", total=10)
    time.sleep(0.02)
    silent.update(0, completed=5, loss=1.0, rate=1.0)
    assert capsys.readouterr().out == ""


def test_a_minus_inf_mask_buffer_is_not_a_divergence() -> None:
    from gpipe_repro.train.loop import _non_finite
    mask = torch.full((4, 4), float("-inf")).triu(1)
    assert _non_finite({"model": {"mask": mask, "w": torch.ones(2)}}) == []
    assert _non_finite({"model": {"var": torch.tensor([1.0, float("inf")])}}) == ["/model/var"]
    assert _non_finite({"opt": [torch.tensor([float("nan")])]}) == ["/opt/0"]


def test_the_run_cuts_on_its_first_micro_batch_with_its_targets(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpipe-repro run` with measured costs hands the engine the first of the R x M micro-batches
    and its targets (the loss is timed with the last layer), as a stage runs them."""
    import gpipe_repro.train.loop as loop
    from gpipe_repro.engine.microbatch import split_minibatch
    from gpipe_repro.train.pipeline import first_micro_batch

    seen: dict[str, Any] = {}

    def build(*args: Any, sample: Any = None, sample_target: Any = None, **kw: Any) -> GPipe:
        seen.update(sample=sample, sample_target=sample_target)
        raise KeyboardInterrupt
    monkeypatch.setattr(loop, "build_pipeline", build)
    run, task = tiny(tmp_path, partitions=2, partition_cost="time")
    with pytest.raises(KeyboardInterrupt):
        train(AmoebaNetTask(task), run)
    x, y = AmoebaNetTask(task).sample_batch(run.batch_size)
    assert seen["sample"].shape[0] == run.batch_size // run.micro_batches
    assert torch.equal(seen["sample_target"], y[:run.batch_size // run.micro_batches])

    replicated = dataclasses.replace(run, replicas=2, micro_batches=2, runtime="distributed")
    first_x, first_y = first_micro_batch((x, y), replicated)
    inputs, targets, _ = split_minibatch(x, y, 2, replicas=2)
    assert torch.equal(first_x, inputs[0]) and torch.equal(first_y, targets[0])
    assert first_x.shape[0] == run.batch_size // 4


@pytest.mark.usefixtures("undrawn_curves")
def test_fp16_skipped_steps_were_said_only_in_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """An fp16 run whose every step overflowed said "finished, 4/4 steps" and nothing else: the model
    never changed, and only train/loss_scale in metrics.jsonl showed it. Each skipped step is now a
    console line, and the summary counts them."""
    from gpipe_repro import GPipe
    from gpipe_repro.train.summary import print_summary

    monkeypatch.setattr(GPipe, "last_step_skipped", property(lambda self: True))
    run, task = tiny(tmp_path / "fp16", precision="fp16", eval_every=0, timeline_every=0)
    summary = train(AmoebaNetTask(task), run)
    out = capsys.readouterr().out
    assert out.count("fp16 overflow, the step was skipped (no cell updated)") == 4, out
    assert summary.skipped_steps == 4
    print_summary(summary, {})
    assert "finished, 4/4 steps (4 skipped: fp16 overflow, no cell updated)" in capsys.readouterr().out
