"""The causal-LM task: byte-level packing, its resumable stream, and `run causal-lm` training a tiny
Hugging Face model through the pipeline from the command line."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gpipe_repro.cli import app
from gpipe_repro.train.tasks.packed_bytes import EOS, IGNORE, PackedBatches, decode, encode, pack

WORDS = "the cat sees a red house and the dog eats small fish near an old tree".split()


def _text(path: Path, lines: int = 120) -> Path:
    """A made-up English text, one sentence per line."""
    sentences = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 6)) + "."
                 for i in range(lines)]
    path.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    return path


def test_documents_are_packed_whole_with_padding_masked_and_ignored() -> None:
    ids, mask, labels = pack(["ab", "cde", "fghijkl", "é"], seq_len=6)
    assert encode("é") == [0xC3, 0xA9, EOS] and decode(encode("é")) == "é"
    rows = [decode(r[m.bool()].tolist()) for r, m in zip(ids, mask)]
    # "ab"+EOS and "cde"+EOS do not share a row of 6; "fghijkl"+EOS is cut into 6 + 2
    assert rows == ["ab", "cde", "fghijk", "lé"]
    assert mask.tolist()[0] == [1, 1, 1, 0, 0, 0]
    assert (labels[mask == 0] == IGNORE).all() and torch.equal(labels[mask == 1], ids[mask == 1])


def test_the_stream_resumes_where_it_stopped_and_reshuffles_each_epoch() -> None:
    rows = pack([f"sentence {i}" for i in range(40)], seq_len=16)
    stream = PackedBatches(rows, batch_size=4, seed=3)
    drawn = [next(stream)[1] for _ in range(stream.batches_per_epoch + 2)]
    again = PackedBatches(rows, batch_size=4, seed=3)
    again.load_state_dict({"drawn": 5})
    assert torch.equal(next(again)[1], drawn[5])
    first, second = (torch.cat(drawn[e * stream.batches_per_epoch:(e + 1) * stream.batches_per_epoch][:2])
                     for e in (0, 1))
    assert not torch.equal(first, second)
    with pytest.raises(ValueError, match="fewer than a mini-batch of 99"):
        PackedBatches(rows, batch_size=99, seed=0)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_causal_lm_trains_a_tiny_model_through_the_pipeline(tmp_path: Path) -> None:
    text = _text(tmp_path / "sentences.txt")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "causal-lm", "--preset", "smoke", "--family", "qwen3",
                                      "--text", str(text), "--k", "2", "--m", "2", "--steps", "3",
                                      "--schedule", "1f1b", "--out", str(out), "--wandb", "disabled",
                                      "--no-progress"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "K=2, M=2" in result.output and "byte-level ids of text" in result.output
    metrics = _rows(out / "metrics.jsonl")
    losses = [r["train/loss"] for r in metrics if "train/loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    evals = [r["eval/loss"] for r in metrics if "eval/loss" in r]
    assert evals and all(math.isfinite(x) for x in evals)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step-00000003.pt"
    # the trained model, exported for transformers: its own forward and loss on the held-out rows
    # give the run's last evaluation (the pipeline's)
    from transformers import AutoModelForCausalLM

    from gpipe_repro.train.tasks.causal_lm import text_documents
    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    ids, mask, labels = (t[:8] for t in pack(text_documents(str(text))[1], 32))
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert float(own) == pytest.approx(evals[-1], rel=1e-5)


@pytest.mark.parametrize("args, says", [
    (["--family", "nonesuch"], "unknown Hugging Face family 'nonesuch'"),
    (["--family", "t5"], "hf:t5 has no causal-LM model in transformers"),
    (["--family", "mamba", "--heads", "1"], "mamba has no heads"),
    (["--text", "{tmp}/missing.txt"], "--text {tmp}/missing.txt: no such file"),
    (["--family", "gpt2", "--kv-heads", "2"], "gpt2 has no kv_heads"),
    (["--heads", "4", "--kv-heads", "3"], "give --kv-heads a divisor of 4"),
    (["--config-file", "{tmp}/nope.json"], "no Hugging Face config at"),
    (["--config-file", "{tmp}/config.json", "--seq-len", "1000"],
     "--seq-len 1000 is longer than the model's 128 positions"),
])
def test_mistakes_are_one_line_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               args: list[str], says: str) -> None:
    from gpipe_repro.train.tasks import causal_lm

    def refuse(*a: Any, **kw: Any) -> Any:
        raise AssertionError("the data were read before the options were checked")
    monkeypatch.setattr(causal_lm, "text_documents", refuse)
    monkeypatch.setattr(causal_lm, "corpus_documents", refuse)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
        "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 128}))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = CliRunner().invoke(app, ["run", "causal-lm", "--preset", "smoke", *args,
                                      "--out", str(tmp_path / "run"), "--wandb", "disabled"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert says.replace("{tmp}", str(tmp_path)) in " ".join(result.output.split()), result.output
    assert not (tmp_path / "run").exists()


def test_resume_trained_on_a_text_edited_under_the_same_path(tmp_path: Path) -> None:
    """Only --text's path was compared on --resume: the same file edited between the runs was
    accepted, and the run went on training on other data. The rows' count and digest are now part
    of the task's settings, so the resume is refused, naming them; the unedited text resumes."""
    text = _text(tmp_path / "sentences.txt")
    out = tmp_path / "run"
    args = ["run", "causal-lm", "--preset", "smoke", "--family", "llama", "--text", str(text),
            "--out", str(out), "--wandb", "disabled", "--no-progress", "--eval-every", "0"]
    first = CliRunner().invoke(app, [*args, "--steps", "2"])
    assert first.exit_code == 0, (first.output, first.exception)
    text.write_text(text.read_text().replace("cat", "elephant"), encoding="utf-8")
    edited = CliRunner().invoke(app, [*args, "--steps", "3", "--resume"])
    assert edited.exit_code == 2 and "data: saved" in edited.output, edited.output
    _text(text)
    again = CliRunner().invoke(app, [*args, "--steps", "3", "--resume"])
    assert again.exit_code == 0, (again.output, again.exception)


def test_silent_warmup_steps_given_were_cut_to_a_tenth_of_the_run() -> None:
    """`run causal-lm --steps 20 --warmup-steps 15` warmed up for 2 steps (the warm-up was capped at
    a tenth of the run, given or not) and run.json said 15. A given --warmup-steps is now used as
    given; one that leaves no step to decay is refused, naming both options; the default stays a
    tenth of the run, at most 30."""
    from types import SimpleNamespace

    from gpipe_repro.train.tasks.causal_lm import CausalLMConfig, CausalLMTask

    def warmup(given: int | None, steps: int) -> int:
        task = SimpleNamespace(settings=CausalLMConfig(warmup_steps=given))
        config = CausalLMTask.optimizer_config(task, total_steps=steps, steps_per_epoch=10,  # type: ignore[arg-type]
                                               batch_size=4)
        return config.warmup_steps
    assert warmup(15, 20) == 15 and warmup(0, 20) == 0
    assert warmup(None, 300) == 30 and warmup(None, 100) == 10 and warmup(None, 1000) == 30
    with pytest.raises(ValueError, match="--warmup-steps 30 leaves no step for the cosine decay of a "
                                         "20-step run"):
        warmup(30, 20)


@pytest.mark.parametrize("family", ["falcon", "gptj", "codegen", "gpt_neo", "bloom", "opt"])
def test_run_causal_lm_refused_families_it_pipelines_for_sizes_it_gave_itself(family: str) -> None:
    """`run causal-lm --family F --preset smoke` failed for families the library pipelines, on
    sizes the user never gave: Falcon on a head size it derives ('leave --head-dim out') and on the
    preset's intermediate width (Falcon's is ffn_hidden_size), GPT-J and CodeGen on a rotary_dim
    (64) wider than the tiny head (16), GPT-Neo on 24 attention types for 2 layers; OPT and BLOOM
    named a size ('no intermediate', 'no positions') where the layers refuse the family itself.
    Sizes a family lacks are left out, those that must follow new sizes follow them, and the
    refusal names its reason."""
    from gpipe_repro.train.hf_spec import ConfigError
    from gpipe_repro.train.tasks.causal_lm import preset

    config = preset("smoke")[1].replace(family=family).sizes_of(family)
    if family in ("bloom", "opt"):
        with pytest.raises(ConfigError, match="cannot be pipelined by causal_lm_layers"):
            config.layer_count()
    else:
        assert config.layer_count() == 2 + 2          # embeddings, two blocks, head


def test_silent_resume_replaced_the_users_files_in_hf(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stopped before its export, then the user's own files put in its hf/ folder: the resumed
    run wrote its export over them without a word (their names are an export's, and a run killed
    before its manifest listed a file claims the files named as its own). The export now writes over
    no file the run did not write: the run says so and exports nothing, the files stay; export_run
    refuses them too, and a file as its `out`, where transformers wrote nothing and said nothing."""
    import os
    import signal

    from gpipe_repro.train.hf_export import export_run
    from gpipe_repro.train.tasks.causal_lm import CausalLMTask

    text, out = _text(tmp_path / "sentences.txt"), tmp_path / "run"
    args = ["run", "causal-lm", "--preset", "smoke", "--family", "qwen3", "--text", str(text),
            "--steps", "3", "--save-every", "1", "--eval-every", "3", "--out", str(out),
            "--wandb", "disabled", "--no-progress"]
    stopped: list[int] = []

    def ctrl_c_at_step_2(self: Any, step: int, total: int) -> None:
        if step == 2 and not stopped:
            stopped.append(step)
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(CausalLMTask, "before_step", ctrl_c_at_step_2)
    first = CliRunner().invoke(app, args)
    assert stopped and not (out / "hf").exists(), first.output
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text('{"mine": 1}')
    resumed = CliRunner().invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0, (resumed.output, resumed.exception)
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
    assert (out / "hf" / "config.json").read_text() == '{"mine": 1}'
    assert "was not exported" in " ".join(resumed.output.split())
    assert not (out / "hf" / "model.safetensors").exists()
    with pytest.raises(FileExistsError, match="did not write"):
        export_run(out)
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(FileExistsError, match="is a file"):
        export_run(out, tmp_path / "a-file")
    assert (tmp_path / "a-file").read_text() == "mine"
    exported = export_run(out, tmp_path / "elsewhere")
    assert (exported / "config.json").is_file() and (exported / "model.safetensors").is_file()


def test_a_sequence_the_host_cannot_hold_is_refused_before_any_work(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`--seq-len 100000` on a tiny LLaMA started training and took 24 GB before the kernel killed
    it (the positions grow to fit the length; attention grows with its square). The run now plans
    its peak (the memory planner, fake tensors) and refuses, before building anything, a plan
    larger than the host's available memory, naming the options that lower it."""
    from gpipe_repro.train import memory_check

    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: 2 ** 20)   # 1 MiB left
    text, out = _text(tmp_path / "sentences.txt", lines=400), tmp_path / "run"
    args = ["run", "causal-lm", "--preset", "smoke", "--family", "llama", "--text", str(text),
            "--out", str(out), "--wandb", "disabled", "--no-progress"]
    refused = CliRunner().invoke(app, [*args, "--seq-len", "512"])
    assert refused.exit_code == 2, (refused.output, refused.exception)
    said = " ".join(refused.output.split())
    assert "of host memory at its peak" in said and "this host has 1 MiB available" in said
    assert "lower --seq-len (512)" in said
    assert not out.exists()
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: 2 ** 40)
    fits = CliRunner().invoke(app, [*args, "--seq-len", "512", "--steps", "1"])
    assert fits.exit_code == 0, (fits.output, fits.exception)


def test_a_size_given_on_resume_with_the_value_the_run_had_is_no_change(tmp_path: Path) -> None:
    """`--resume --hidden 64` on a run whose preset left the width to the family's tiny 64 was refused
    as "hidden: saved not given, now 64": a size left out is compared through the model it gives.
    Another size is still refused, naming it and the model."""
    text, out = _text(tmp_path / "sentences.txt"), tmp_path / "run"
    args = ["run", "causal-lm", "--preset", "smoke", "--text", str(text), "--out", str(out),
            "--wandb", "disabled", "--no-progress"]
    first = CliRunner().invoke(app, [*args, "--steps", "2"])
    assert first.exit_code == 0, (first.output, first.exception)
    layers = json.loads((out / "run.json").read_text())["config"]["task"]["model"]
    assert "layers 2" in layers
    other = CliRunner().invoke(app, [*args, "--steps", "3", "--resume", "--layers", "3"])
    assert other.exit_code == 2 and "layers: saved not given" in other.output, other.output
    same = CliRunner().invoke(app, [*args, "--steps", "3", "--resume", "--layers", "2"])
    assert same.exit_code == 0, (same.output, same.exception)
