"""`gpipe-repro run` as a user types it (issue 16): the headline command's batch follows M, micro-batches
too small for BatchNorm are refused with a suggestion, presets are listed with their values, a
distributed mistake is one line before any process starts, and exit codes say how a run ended."""
from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpipe_repro.cli import app
from gpipe_repro.commands.run import MIN_BATCHNORM_MICRO_BATCH, exit_code_of
from gpipe_repro.train import ranks
from gpipe_repro.train.tasks.image_classification import pipelining_runtime


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """Capture what `gpipe-repro run` would train instead of training it."""
    monkeypatch.chdir(tmp_path)
    seen: list[Any] = []

    def fake_launch(task_factory: Any, config: Any) -> Any:
        seen.append(config)
        return type("Summary", (), {"status": "finished"})()

    monkeypatch.setattr(ranks, "launch", fake_launch)
    return seen


def test_the_headline_command_keeps_micro_batches_batchnorm_can_use(launched: list[Any]) -> None:
    result = CliRunner().invoke(app, ["run", "amoebanet", "--k", "4", "--m", "32"])
    assert result.exit_code == 0, result.output
    config = launched[0]
    assert (config.partitions, config.micro_batches) == (4, 32)
    assert config.batch_size // config.micro_batches >= MIN_BATCHNORM_MICRO_BATCH
    assert "the batch follows --m" in result.output
    assert Path(config.out_dir) == Path("runs/amoebanet-cpu")          # not the published results
    # pipelined for real where the host has cores for it, without re-materialization (the
    # ten-minute target; docs/training.md, "The cpu preset pipelines for real")
    assert config.runtime == pipelining_runtime() and config.checkpoint == "never"


def test_interleaved_without_a_runtime_falls_back_to_the_local_runtime(launched: list[Any],
                                                                       monkeypatch: Any) -> None:
    import gpipe_repro.train.tasks.image_classification as ic
    monkeypatch.setattr(ic, "pipelining_runtime", lambda: "distributed")
    result = CliRunner().invoke(app, ["run", "amoebanet", "--schedule", "interleaved"])
    assert result.exit_code == 0, result.output
    assert launched[-1].runtime == "local" and "interleaved runs with the local runtime" in result.output


def test_an_explicit_batch_is_kept_and_too_small_micro_batches_are_refused(launched: list[Any]) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["run", "amoebanet", "--k", "4", "--m", "32", "--batch-size", "64"])
    assert result.exit_code == 2 and not launched
    assert "2 examples per micro-batch" in result.output
    assert f"--batch-size {32 * MIN_BATCHNORM_MICRO_BATCH}" in result.output
    result = runner.invoke(app, ["run", "amoebanet", "--m", "32", "--batch-size", "64",
                                 "--small-micro-batches"])
    assert result.exit_code == 0 and launched[-1].batch_size == 64


def test_record_writes_the_results_of_record_only_when_asked(launched: list[Any]) -> None:
    assert CliRunner().invoke(app, ["run", "amoebanet", "--record"]).exit_code == 0
    assert Path(launched[-1].out_dir) == Path("results/training/amoebanet-cpu")


def test_presets_are_listed_with_their_values() -> None:
    result = CliRunner().invoke(app, ["run", "amoebanet", "--preset", "list"])
    assert result.exit_code == 0
    for expected in ("cpu:", "paper:", "smoke:", "K=4, M=4, batch 64", "L=18, F=512"):
        assert expected in result.output


def test_a_distributed_mistake_is_one_line_before_any_process_starts(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_repro.distributed import launcher
    monkeypatch.setattr(launcher, "launch_local", lambda *a, **k: pytest.fail("a process was started"))
    result = CliRunner().invoke(app, ["run", "amoebanet", "--preset", "smoke", "--k", "50", "--runtime",
                                      "distributed", "--out", str(tmp_path / "run"), "--wandb", "disabled"])
    assert result.exit_code == 2
    assert "--k 50 cuts the model into 50 cells, and it has 10 layers" in result.output
    assert len(result.output.strip().splitlines()) <= 3, result.output   # no process: launch_local fails


def test_replicas_reach_the_run_and_need_the_distributed_runtime(launched: list[Any]) -> None:
    """Issue #13: --replicas on both run commands; with the local runtime it is one clear line, before
    anything is built."""
    ok = CliRunner().invoke(app, ["run", "amoebanet", "--preset", "smoke", "--k", "2", "--replicas", "2",
                                  "--m", "2", "--runtime", "distributed", "--wandb", "disabled"])
    assert ok.exit_code == 0, ok.output
    assert launched[-1].replicas == 2 and launched[-1].partitions == 2
    for command in (["amoebanet"], ["transformer", "--languages", "all"]):
        refused = CliRunner().invoke(app, ["run", *command, "--preset", "smoke", "--replicas", "2",
                                           "--wandb", "disabled"])
        assert refused.exit_code == 2, refused.output
        assert "--replicas 2 needs --runtime distributed" in refused.output
        assert len(refused.output.strip().splitlines()) <= 3, refused.output


def test_exit_codes_say_how_the_run_ended() -> None:
    def summary(status: str, signum: int | None = None) -> Any:
        return type("S", (), {"status": status, "signal": signum})()

    assert exit_code_of(summary("finished")) == 0
    assert exit_code_of(summary("interrupted", signal.SIGINT)) == 130
    assert exit_code_of(summary("interrupted", signal.SIGTERM)) == 143
    assert exit_code_of(summary("interrupted")) == 1


# ----------------------------------------------------------------------- README, docs and --help agree

def readme_command_lines() -> list[list[str]]:
    """Every `gpipe-repro ...` line in the code blocks of README.md and docs/*.md, as arguments
    (comments removed)."""
    import re
    import shlex
    root = Path(__file__).resolve().parents[2]
    text = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        block = re.sub(r"\\\n\s*", " ", block)   # a command continued with a backslash is one line
        for line in block.splitlines():
            line = line.strip()
            if line.startswith("gpipe-repro "):
                lines.append(shlex.split(line.split("  #")[0].split(" # ")[0])[1:])
    return lines


def parse_only(args: list[str]) -> None:
    """Parse a command line as the CLI would, without running the command (click's own parser,
    the copy typer ships): an unknown option or a bad value raises."""
    import typer.main
    command: Any = typer.main.get_command(app)
    ctx = command.make_context("gpipe-repro", list(args))
    while hasattr(command, "resolve_command"):           # a group: descend to the subcommand
        pending = list(getattr(ctx, "_protected_args", [])) + list(ctx.args)
        name, sub, rest = command.resolve_command(ctx, pending)
        assert sub is not None, f"unknown command {name!r} in {args}"
        command, ctx = sub, sub.make_context(name, rest, parent=ctx)


def test_every_readme_command_line_parses() -> None:
    lines = readme_command_lines()
    assert len(lines) >= 5
    for args in lines:
        parse_only(args)
    with pytest.raises(Exception, match="bogus"):
        parse_only(["run", "amoebanet", "--bogus"])


def test_the_same_flags_mean_the_same_everywhere_and_there_are_no_hidden_spellings() -> None:
    for args in (["pipeline", "--partitions", "2"], ["pipeline", "--micro-batches", "4"],
                 ["pipeline", "--batch", "64"], ["run", "amoebanet", "--batch", "64"]):
        with pytest.raises(Exception, match="No such option"):
            parse_only(args)
    for command in (["fit", "transformer-lm"], ["pipeline"], ["run", "amoebanet"]):
        result = CliRunner().invoke(app, [*command, "--help"], terminal_width=200)
        for flag in ("--k", "--m", "--batch-size", "--out"):
            assert flag in result.output, (command, flag)
        assert "--partitions" not in result.output and "--micro-batches" not in result.output


def test_a_run_reuses_the_vocabulary_corpus_build_made(tmp_path: Path) -> None:
    from gpipe_repro.commands.run_transformer import corpus_vocabulary
    corpus = tmp_path / "bible"
    assert corpus_vocabulary("bible", str(tmp_path)) is None
    (corpus / "spm8000").mkdir(parents=True)
    (corpus / "spm4000-1langs-0123abcd").mkdir()          # a run's subset vocabulary: not the corpus's
    assert corpus_vocabulary("bible", str(tmp_path)) == 8000
    (corpus / "spm16000").mkdir()
    assert corpus_vocabulary("bible", str(tmp_path)) is None   # ambiguous: the preset's size is used


def test_every_visible_option_of_every_command_is_documented() -> None:
    import typer.main
    undocumented = []

    def walk(command: Any, path: list[str]) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])
        for param in getattr(command, "params", []):
            if param.param_type_name == "option" and not getattr(param, "hidden", False) \
                    and not (param.help or "").strip():
                undocumented.append(f"{' '.join(path)} {param.opts[0]}")

    walk(typer.main.get_command(app), [])
    assert not undocumented, undocumented


def test_both_run_commands_take_every_shared_pipeline_option_as_declared_once(launched: list[Any]) -> None:
    """Each option of PIPELINE_OPTIONS reaches `run amoebanet` and `run transformer` with its one
    declaration (flags, default, help), and its value reaches the RunConfig."""
    import typer.main

    from gpipe_repro.commands.options import PIPELINE_OPTIONS
    run = typer.main.get_command(app).commands["run"]                       # type: ignore[attr-defined]
    for task in ("amoebanet", "transformer"):
        params = {p.name: p for p in run.commands[task].params}
        for option in PIPELINE_OPTIONS:
            param = params[option.name]
            flags = [*param.opts, *(f"{a}/{b}" for a, b in zip(param.opts, param.secondary_opts))]
            assert param.default == option.default and not param.hidden, (task, option.name)
            assert not option.flags or set(option.flags) <= set(flags), (task, option.name, flags)
            if option.name != "batch_size":
                assert param.help == option.help, (task, option.name)
    result = CliRunner().invoke(app, ["run", "amoebanet", "--k", "2", "--m", "2", "--batch-size", "32",
                                      "--seed", "7", "--no-progress", "--name", "x"])
    assert result.exit_code == 0, result.output
    config = launched[-1]
    assert (config.partitions, config.micro_batches, config.batch_size, config.seed, config.progress) \
        == (2, 2, 32, 7, False)


def test_a_run_command_cannot_redeclare_a_shared_option() -> None:
    from gpipe_repro.commands.options import pipeline_options

    def clashing(*, k: int = 1, pipeline: dict[str, Any]) -> None: ...

    def without_pipeline(*, preset: str = "cpu") -> None: ...

    for command, message in ((clashing, r"\['k'\]"), (without_pipeline, "pipeline")):
        with pytest.raises(TypeError, match=message):
            pipeline_options()(command)


@pytest.mark.parametrize("option", [["--genotype", "Z"], ["--optimizer", "foo"], ["--k", "20"]])
def test_a_run_refused_while_building_its_model_leaves_no_run_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: list[str]) -> None:
    """Options found wrong only once the model or the optimizer is built (a genotype, an optimizer, a
    K above the layer count) left runs/amoebanet-smoke-N holding nothing but its manifest, and the
    run counter went up each time. The run removes what it wrote, and the directory it claimed (and
    an empty runs/ it made: it was left behind); an empty directory of the user's given with --out
    stays."""
    monkeypatch.chdir(tmp_path)
    args = ["run", "amoebanet", "--preset", "smoke", "--wandb", "disabled", *option]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "runs").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    result = CliRunner().invoke(app, [*args, "--out", str(mine)])
    assert result.exit_code == 2, result.output
    assert mine.is_dir() and not any(mine.iterdir())
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "new")])
    assert result.exit_code == 2 and not (tmp_path / "new").exists()


def test_a_language_model_batch_follows_m_only_where_it_must(launched: list[Any]) -> None:
    """`run causal-lm --m 100` grew the batch from 4 to 800 rows with a note about BatchNorm (the
    model has none) and a learning rate that scales (it stays): without BatchNorm the batch grows only
    to one row per micro-batch, and the note says so."""
    result = CliRunner().invoke(app, ["run", "causal-lm", "--preset", "smoke", "--m", "100",
                                      "--wandb", "disabled"])
    assert result.exit_code == 0, result.output
    assert launched[-1].batch_size == 100 and launched[-1].micro_batches == 100
    assert "every micro-batch has a row" in result.output and "BatchNorm" not in result.output


def test_a_run_checks_its_out_before_building_its_data(launched: list[Any], tmp_path: Path) -> None:
    """`run causal-lm --out <another task's run>` built the offline corpus for 45 s before refusing."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    result = CliRunner().invoke(app, ["run", "causal-lm", "--preset", "smoke", "--out", str(other),
                                      "--wandb", "disabled"])
    assert result.exit_code == 2 and "is not a previous training run" in result.output
    assert not launched


def test_a_launcher_without_the_distributed_runtime_is_refused(launched: list[Any]) -> None:
    """`--launcher torchrun` with the local runtime was silently ignored."""
    result = CliRunner().invoke(app, ["run", "amoebanet", "--preset", "smoke", "--runtime", "local",
                                      "--launcher", "torchrun", "--wandb", "disabled"])
    assert result.exit_code == 2 and "add --runtime distributed" in result.output and not launched


@pytest.mark.parametrize("option, says", [
    (["--seed", "-1"], r"--seed\) must be a whole number from 0"),
    (["--seed", "99999999999999999999"], r"--seed\) must be a whole number from 0"),
    (["--epochs", "0", "--steps", "2"], "--epochs must be > 0"),
    (["--epochs", "-1", "--steps", "2"], "--epochs must be > 0"),
])
def test_a_bad_seed_or_epochs_is_named_before_any_work(tmp_path: Path, option: list[str], says: str) -> None:
    """--seed -1 wrote the run directory and started W&B before torch said 'expected non-negative
    integer' (a seed past 2**63 'Overflow when unpacking long long'), naming no option; --epochs 0
    or -1 beside --steps was taken without a word. Each is now one line naming the option, and
    nothing is written."""
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "amoebanet", "--preset", "smoke", "--wandb", "disabled",
                                      "--out", str(out), *option])
    assert result.exit_code == 2 and re.search(says, result.output), result.output
    assert not out.exists()


def test_a_second_ctrl_c_exited_130_saying_nothing(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A second Ctrl-C aborts the step at once; the run exited 130 with "finishing this step,
    saving" as its last line (typer swallowed the KeyboardInterrupt's message), so the user could
    not tell that nothing was saved. It now says so, and where --resume continues from."""
    import typer

    from gpipe_repro.commands import run as run_command
    from gpipe_repro.train import checkpoints, ranks

    def interrupted(*_: Any) -> Any:
        with checkpoints.graceful_interrupt():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
    monkeypatch.setattr(ranks, "launch", interrupted)
    with pytest.raises(typer.Exit) as exited:
        run_command.run_task(lambda: (lambda: None, None))
    assert exited.value.exit_code == 130
    err = capsys.readouterr().err
    assert "aborted without saving this step" in err and "--resume" in err


def test_split_backwards_reaches_the_run_or_is_refused_with_what_to_change(launched: list[Any]) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["run", "amoebanet", "--schedule", "zb-h1", "--split-backwards", "1"])
    assert result.exit_code == 0, result.output
    assert launched[-1].schedule == "zb-h1" and launched[-1].split_backwards == 1
    for argv, message in [
            (["--schedule", "1f1b", "--split-backwards", "1"], "--schedule 1f1b runs whole backwards"),
            (["--schedule", "zb-h1", "--split-backwards", "some"], "a count (0 to --m) or auto, got 'some'"),
            (["--schedule", "zb-h1", "--split-backwards", "auto", "--partition-cost", "params"],
             "add --partition-cost time")]:
        result = runner.invoke(app, ["run", "amoebanet", *argv])
        assert result.exit_code == 2 and message in result.output, (argv, result.output)
    result = runner.invoke(app, ["run", "amoebanet", "--schedule", "zb-h1", "--split-backwards", "auto",
                                 "--partition-cost", "time"])
    assert result.exit_code == 0 and launched[-1].split_backwards == "auto", result.output


@pytest.mark.parametrize("argv, says", [
    (["amoebanet", "--preset", "smoke", "--k", "50"], "--k 50 cuts the model into 50 cells, and it has 10"),
    (["amoebanet", "--preset", "smoke", "--k", "12", "--schedule", "zb-v"], "it has 10 layers"),
    (["amoebanet", "--preset", "smoke", "--k", "5", "--schedule", "zb-v"], "is not even; use --k 6"),
    (["amoebanet", "--preset", "smoke", "--k", "3", "--schedule", "interleaved"], "use --k 2"),
    (["amoebanet", "--preset", "smoke", "--k", "4", "--m", "3", "--schedule", "interleaved"],
     "--m 3 is not a multiple of 2; use --m 4"),
    (["amoebanet", "--preset", "smoke", "--k", "4", "--m", "2", "--schedule", "dualpipe-v",
      "--small-micro-batches"], "use --m 4 or more, or --schedule zb-v"),
    (["amoebanet", "--preset", "smoke", "--optimizer", "lion"], "--optimizer lion: unknown"),
    (["amoebanet", "--preset", "smoke", "--genotype", "Z"], "unknown AmoebaNet genotype 'Z'"),
    (["causal-lm", "--preset", "smoke", "--k", "50"], "it has 4 layers: use --k 4 or less"),
    (["transformer", "--preset", "smoke", "--k", "50"], "give the model more layers (--layers)"),
    (["transformer", "--preset", "smoke", "--temperature", "0"], "--temperature must be > 0"),
    (["transformer", "--preset", "smoke", "--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    (["transformer", "--preset", "smoke", "--languages", ""], "--languages '' names no language"),
    (["transformer", "--preset", "smoke", "--languages", " , "], "names no language"),
    (["transformer", "--preset", "smoke", "--data-dir", "/proc/version"], "is a file: give a directory"),
])
def test_a_k_an_optimizer_or_a_genotype_the_model_cannot_take_is_refused_before_the_data(
        launched: list[Any], argv: list[str], says: str) -> None:
    """`run causal-lm --k 50` built the offline corpus for 45 s, and `run amoebanet --k 50`,
    `--optimizer lion`, `--genotype Z`, a --k or --m the schedule does not take (zb-v on an odd K,
    dualpipe-v with M < 2K) loaded the images, before the model, the optimizer or the schedule said
    no (naming `partitions=50`, not the option). The layer count comes from the model built on the
    meta device, K counts cells as GPipe(partitions=K) does, and each is one line naming the
    options before the run is launched (the launch builds the task, which reads the data)."""
    result = CliRunner().invoke(app, ["run", *argv, "--wandb", "disabled"])
    assert result.exit_code == 2 and says in " ".join(result.output.split()), result.output
    assert not launched


def test_sigterm_while_a_run_sets_up_leaves_no_stub_directory(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM after a run claimed its directory and before its first step killed the process with
    the default handler (no exit code 143), leaving runs/<name> holding only its manifest, which
    --resume and --out then refused. It now stops as Ctrl-C does there: one line, exit code 143,
    the claimed directory released; the caller's handler is put back."""
    import os
    monkeypatch.chdir(tmp_path)

    def terminated_while_loading(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal did not stop the run")
    monkeypatch.setattr(ranks, "launch", terminated_while_loading)
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(app, ["run", "amoebanet", "--preset", "smoke", "--wandb", "disabled"])
    assert result.exit_code == 143 and "SIGTERM before training began" in result.output, result.output
    assert not (tmp_path / "runs").exists()
    assert signal.getsignal(signal.SIGTERM) is before
