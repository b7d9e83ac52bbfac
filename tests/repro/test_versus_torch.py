"""versus-torch: torchtitan's cut of the heterogeneous models, the tie undone on PyTorch's side, and
the tiny mode end to end (every row, both sides' best named; no timing judged); the entry point
refuses a dirty tree before any work."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from experiments.versus_models import MODELS, StageChunk, chunk_layers, untied


def test_chunk_layers_puts_the_ends_on_the_end_chunks_and_the_blocks_in_equal_runs() -> None:
    layers: list[nn.Module] = [nn.Identity() for _ in range(12)]    # embedding, 10 blocks, head
    cut = chunk_layers(layers, 4)
    assert [len(c) for c in cut] == [1 + 3, 3, 2, 2 + 1]
    assert cut[0][0] is layers[0] and cut[-1][-1] is layers[-1]
    assert [m for c in cut for m in c] == layers


def test_chunk_layers_refuses_fewer_blocks_than_chunks() -> None:
    with pytest.raises(ValueError, match="do not cut"):
        chunk_layers([nn.Identity() for _ in range(4)], 4)


def test_untied_gives_the_later_layer_its_own_copy_of_a_shared_weight() -> None:
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    first, last = untied([emb, nn.Identity(), head])[::2]
    assert first is emb and last is not head
    assert last.weight is not emb.weight and torch.equal(last.weight, emb.weight)


def test_stage_chunk_hands_several_arguments_to_its_first_layer_as_one_tuple() -> None:
    class Pair(nn.Module):
        def forward(self, x: Any) -> Any:
            a, b = x
            return a + b
    assert StageChunk([Pair()])(torch.ones(2), torch.ones(2)).tolist() == [2.0, 2.0]
    assert StageChunk([nn.Identity()])(torch.ones(1)).tolist() == [1.0]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_heterogeneous_model_runs_the_same_in_torchtitans_chunks(name: str) -> None:
    spec = MODELS[name]
    x, y = spec.sample(spec.tiny_batch, True)
    whole = spec.build(True)
    ref = nn.Sequential(*whole).eval()(x)
    chunks = [StageChunk(c).eval() for c in chunk_layers(untied(spec.build(True)), 4)]
    h: Any = x
    for c in chunks:
        h = c(*h) if isinstance(h, tuple) else c(h)
    torch.testing.assert_close(h, ref)
    assert spec.loss_fn(h, y).dim() == 0


@pytest.mark.slow
def test_tiny_run_gives_a_row_per_group_with_both_sides_best(capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.versus_torch import app
    from tests.repro.tiny_runs import tiny_page
    text = tiny_page(app, ["--tiny", "--models", "transformer,llama"], capsys)
    assert "TINY RUN: not of record" in text
    for name in ("mlp", "transformer", "llama"):
        assert f"| {name} " in text
    assert "| Schedule" in text


@pytest.mark.slow
def test_same_cut_times_ours_on_torchtitans_cut_against_torchs_same_schedule(
        capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.versus_torch import app
    from tests.repro.tiny_runs import tiny_page
    text = tiny_page(app, ["--tiny", "--models", "llama", "--no-uniform", "--same-cut"], capsys)
    assert "Ours on torchtitan's cut against PyTorch's same schedule" in text
    for schedule in ("gpipe", "1f1b"):
        assert f"- llama M=2, {schedule}: ours " in text


def test_the_entry_point_refuses_a_dirty_tree_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    from experiments import versus_torch
    monkeypatch.setattr("gpipe_repro.report.provenance.changed_files",
                        lambda repo=None: ["gpipe_repro/engine/gpipe.py"])
    monkeypatch.setattr("gpipe_repro.report.output_guard.is_of_record", lambda path: True)
    monkeypatch.setattr("gpipe_repro.distributed.launch_local",
                        lambda *a, **k: pytest.fail("measured from a dirty tree"))
    with pytest.raises(SystemExit, match="only from a clean commit"):
        versus_torch.main(models="transformer", uniform=True, ms="4,8", warmup=1, tiny=False, budget=1.0,
                          tolerance=0.02, min_rounds=1, max_rounds=1)


def test_finalists_keep_each_sides_fastest_and_the_same_cut_pairs() -> None:
    from experiments.versus_torch import finalists
    from gpipe_repro.report.measurement import Figure, Measurement

    medians = {"ours:gpipe": 3.0, "ours:1f1b": 1.0, "ours:zb-h1": 2.0, "torch:ScheduleGPipe": 5.0,
               "torch:Schedule1F1B": 4.0, "torch:ScheduleDualPipeV": 6.0, "same-cut:gpipe": 9.0}
    times = {n: Figure.of(n, [t, t]) for n, t in medians.items()}
    selection = Measurement({}, times, 2, "max rounds", 1.0, None).to_json()
    assert finalists(selection, 2) == ["ours:1f1b", "ours:zb-h1", "torch:Schedule1F1B",
                                       "torch:ScheduleGPipe", "same-cut:gpipe"]
    assert finalists(selection, 1) == ["ours:1f1b", "torch:Schedule1F1B", "same-cut:gpipe",
                                       "torch:ScheduleGPipe"]

