"""throughput-table, validate-sim, memory-table and `throughput --model`: their output directory (or
--out file) is checked before any work: a user's file is never replaced, the command's own only with
--overwrite, the results of record only by the make target (the make targets give
--record); the default honours $GPIPE_REPRO_RESULTS. And `throughput --model` mistakes are
one-line usage errors before the timing work."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpipe_repro.cli import app
from gpipe_repro.report import output_guard
from gpipe_repro.report.records import write_json


def _no_work(*args: Any, **kw: Any) -> Any:
    raise AssertionError("the work started before the output directory was checked")


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Any:
    from gpipe_repro.repro import throughput_table
    monkeypatch.setattr(throughput_table, "run_with_progress", _no_work)
    return throughput_table


def _refused(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str], says: str,
             **kw: Any) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv, **kw)
    assert exit_.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert says in err, err


def _usage_error(args: list[str], says: str) -> None:
    """`gpipe-repro ARGS` stops with a usage error (exit code 2) that says `says`."""
    result = CliRunner().invoke(app, args, terminal_width=400)
    assert result.exit_code == 2, (result.output, result.exception)
    assert says in " ".join(result.output.replace("│", " ").split()), result.output


def _starts_work(args: list[str]) -> None:
    """`gpipe-repro ARGS` passes its checks and starts the (stubbed) work."""
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, AssertionError) and "work started" in str(result.exception), \
        result.output


def test_throughput_table_refuses_a_users_file(table: Any, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "speedup.png").write_text("my plot")
    for extra in ([], ["--overwrite"]):
        _usage_error(["throughput-table", "--no-measure", "--out", str(tmp_path), *extra],
                     "not a previous `gpipe-repro throughput-table` output")
    assert (tmp_path / "speedup.png").read_text() == "my plot"


def test_throughput_table_replaces_its_own_only_with_overwrite(table: Any, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    write_json(tmp_path / "throughput_table.json", {"table2": {}, "table3": {}, "settings": {}})
    (tmp_path / "speedup.png").write_text("its own plot")
    _usage_error(["throughput-table", "--no-measure", "--out", str(tmp_path)], "pass --overwrite")
    _starts_work(["throughput-table", "--no-measure", "--out", str(tmp_path), "--overwrite"])


def test_results_of_record_only_through_the_make_target(table: Any, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(output_guard, "checkout_results", lambda: tmp_path)
    monkeypatch.setattr(output_guard.provenance, "changed_files", lambda repo=None: [])   # a clean checkout
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setenv("GPIPE_REPRO_RESULTS", str(tmp_path))      # the default: $GPIPE_REPRO_RESULTS
    write_json(tmp_path / "throughput" / "throughput_table.json",
               {"table2": {}, "table3": {}, "settings": {}, "written_by": "throughput-table"})
    _usage_error(["throughput-table", "--no-measure", "--overwrite"], "`make throughput-table`")
    _starts_work(["throughput-table", "--no-measure", "--record"])


def test_the_make_targets_entry_points_pass_record(monkeypatch: pytest.MonkeyPatch) -> None:
    import runpy

    monkeypatch.setattr("sys.argv", ["experiment"])
    for module, experiment in (("gpipe_repro.repro.throughput_table", "experiments.throughput_table"),
                               ("gpipe_repro.repro.validate_simulator", "experiments.validate_simulator"),
                               ("gpipe_repro.repro.memory_table", "experiments.memory_table"),
                               ("gpipe_repro.repro.validate_unseen", "experiments.validate_unseen"),
                               ("gpipe_repro.repro.replicas_plan_table", "experiments.replicas_plan_table")):
        seen: list[Any] = []
        monkeypatch.setattr(f"{module}.main", lambda *a, seen=seen, **kw: seen.append(kw))
        with pytest.raises(SystemExit):
            runpy.run_module(experiment, run_name="__main__")
        assert len(seen) == 1 and seen[0]["record"] is True, experiment


def test_validate_sim_refuses_a_users_page_before_measuring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from gpipe_repro.repro import validate_simulator as vs
    monkeypatch.setattr(vs, "distributed_measure", _no_work)
    monkeypatch.setattr(vs, "validate_simulator", _no_work)
    monkeypatch.setattr(vs, "usable_cores", lambda: 8)       # --ks 2 fits whatever this host has
    (tmp_path / "validation.md").write_text("my own page\n")
    for extra in ([], ["--overwrite"]):
        _usage_error(["validate-sim", "--ks", "2", "--out", str(tmp_path), *extra],
                     "not a previous `gpipe-repro validate-sim` output")
    assert (tmp_path / "validation.md").read_text() == "my own page\n"
    # its own earlier validation: only with --overwrite
    (tmp_path / "validation.md").unlink()
    write_json(tmp_path / "validation.json", {"rows": [], "summary": {}, "written_by": "validate-sim"})
    (tmp_path / "validation.md").write_text("its own page\n")
    _usage_error(["validate-sim", "--ks", "2", "--out", str(tmp_path)], "pass --overwrite")
    _starts_work(["validate-sim", "--ks", "2", "--out", str(tmp_path), "--overwrite"])


def test_validate_sim_default_honours_the_environment(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_repro.repro import validate_simulator as vs
    monkeypatch.setattr(vs, "validate_simulator", _no_work)
    monkeypatch.setattr(vs, "distributed_measure", lambda *a, **kw: None)
    monkeypatch.setattr(vs, "usable_cores", lambda: 8)
    monkeypatch.setattr(vs, "check_out_dir", lambda out, **kw: (_ for _ in ()).throw(
        AssertionError(f"out={out}")))
    monkeypatch.setenv("GPIPE_REPRO_RESULTS", str(tmp_path))
    with pytest.raises(AssertionError, match=f"out={tmp_path / 'throughput'}"):
        vs.main(ks=[2])


def test_memory_table_checks_its_directory_before_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import gpipe_repro.repro.memory_table as mt
    monkeypatch.setattr(mt, "run", _no_work)
    (tmp_path / "memory_table.md").write_text("mine\n")
    _usage_error(["memory-table", "--out", str(tmp_path), "--overwrite"],
                 "not a previous `gpipe-repro memory-table` output")
    monkeypatch.setenv("GPIPE_REPRO_RESULTS", str(tmp_path / "r"))
    write_json(tmp_path / "r" / "memory" / "memory_table.json",
               {"transformer": {}, "scaling": {}, "validation": {}, "settings": {}})
    _usage_error(["memory-table"], "pass --overwrite")                # the default is under $…RESULTS
    _starts_work(["memory-table", "--overwrite"])


# ----------------------------------------------------------------------------- throughput --model

@pytest.fixture
def own_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "review_model.py").write_text(textwrap.dedent("""
        from torch import nn
        def layers(width=64, depth=2):
            out = []
            for i in range(depth):
                out += [nn.Linear(width if i else 32, width), nn.ReLU()]
            return nn.Sequential(*out, nn.Linear(width, 10))
        def notseq():
            return 42
        def strings():
            return ["a", "b"]
        def tied():
            shared = nn.Linear(32, 32)
            return [shared, nn.ReLU(), shared, nn.Linear(32, 10)]
        def as_dict():
            return {"a": nn.Linear(32, 10)}
        def normed():
            return [nn.Linear(32, 16), nn.BatchNorm1d(16), nn.Linear(16, 10)]
        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    from gpipe_repro.repro import simulate_model
    monkeypatch.setattr(simulate_model, "simulate_model", _no_work)
    return "review_model"


@pytest.mark.parametrize("args, says", [
    (["--model", "{m}:layers", "--input-shape", "31"],
     "--input-shape (31) does not fit the model: its first layer raised: RuntimeError"),
    # the option to change named: a BatchNorm on one example, token ids into a float layer
    (["--model", "{m}:normed", "--input-shape", "32", "--microbatch", "1"],
     "--microbatch 1: its layer 1 (BatchNorm1d) (a BatchNorm) cannot train on one value per channel"),
    (["--model", "{m}:layers", "--input-shape", "32", "--kind", "tokens"],
     "--kind tokens gives the model integer token ids, and its first layer raised"),
    (["--model", "{m}:layers", "--input-shape", "-3"], "--input-shape takes sizes >= 1"),
    (["--model", "{m}:layers", "--input-shape", "0"], "--input-shape takes sizes >= 1"),
    (["--model", "{m}:notseq", "--input-shape", "32"], "must return an nn.Sequential or a list of "
                                                       "nn.Module layers; it returned int"),
    (["--model", "{m}:strings", "--input-shape", "32"], "it returned a sequence holding str"),
    (["--model", "{m}:as_dict", "--input-shape", "32"], "layers; it returned a dict"),
    (["--model", "{m}:NOT_CALLABLE", "--input-shape", "32"], "{m}.NOT_CALLABLE (int) is not a function"),
    (["--model", "{m}:missing", "--input-shape", "32"], "'{m}' has no function 'missing'"),
    (["--model", "{m}", "--input-shape", "32"], "named as module:function, e.g. --model {m}:make_model"),
    (["--model", "{m}:layers", "--input-shape", "32", "--option", "width=abc"],
     "building the model raised TypeError"),
    (["--model", "{m}:layers", "--input-shape", "32", "--repeats", "0"], "--repeats must be >= 1"),
    (["--model", "{m}:layers", "--input-shape", "32", "--k", "0"], "--k must be >= 1"),
    (["--model", "{m}:layers", "--input-shape", "32", "--classes", "500"],
     "does not fit its targets (features, --classes 500)"),
    # more cells than layers: a setting to change (exit code 2), not a failed simulation (1)
    (["--model", "{m}:layers", "--input-shape", "32", "--k", "6"], "k=6 cells for a model of 5 layers"),
])
def test_own_model_mistakes_are_usage_errors_before_the_timing(own_model: str, args: list[str], says: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(m=own_model) for a in args]
    if "--k" not in argv:
        argv += ["--k", "2"]
    _usage_error(["throughput", *argv, "--m", "4", "--no-validate"], says.format(m=own_model))


def test_own_model_json_is_checked_before_the_timing(own_model: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "r.json"
    mine.write_text("mine\n")
    argv = ["throughput", "--model", f"{own_model}:layers", "--input-shape", "32", "--k", "2", "--m", "4",
            "--out", str(mine)]
    _usage_error([*argv, "--overwrite"], "not a previous `gpipe-repro throughput`")
    write_json(mine, {"k": 2, "written_by": "throughput"})
    _usage_error(argv, "pass --overwrite")
    _starts_work([*argv, "--overwrite"])       # a shape that fits: on to the work


def test_replicas_plan_table_replaced_a_users_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`replicas-plan-table` wrote results/replicas/plan.json over whatever was there (it had no
    --overwrite). A file it did not write is now refused before any planning, and its own earlier
    plan is replaced only with --overwrite."""
    from gpipe_repro.report.output_guard import OutputRefused
    from gpipe_repro.repro import replicas_plan_table as table

    monkeypatch.setenv("GPIPE_REPRO_RESULTS", str(tmp_path))
    mine = tmp_path / "replicas" / "plan.json"
    mine.parent.mkdir(parents=True)
    mine.write_text('{"mine": true}')
    with pytest.raises(OutputRefused, match="not a previous `gpipe-repro replicas-plan-table`"):
        table.main(ms=[4], devices=[8])
    assert mine.read_text() == '{"mine": true}'
    mine.unlink()
    table.main(ms=[4], devices=[8])
    with pytest.raises(OutputRefused, match="pass --overwrite"):
        table.main(ms=[4], devices=[8])
    table.main(ms=[4], devices=[8], overwrite=True)


@pytest.mark.parametrize("args, says", [
    (["--input-shape", "32", "--k", "2", "--m", "4"], "missing --model: give --model, --input-shape"),
    (["--model", "{m}:layers", "--input-shape", "32"], "missing --k, --m: give"),
    (["--model", "{m}:layers", "--input-shape", "32", "--k", "64", "--m", "4", "--validate"],
     "use --k <= "),
])
def test_own_model_messages_name_this_commands_options(own_model: str, args: list[str], says: str) -> None:
    """The options missing are named, and a limit is said in the command's options (--no-validate),
    not in the Python API's arguments (validate=False)."""
    result = CliRunner().invoke(app, ["throughput", *[a.format(m=own_model) for a in args]],
                                terminal_width=400)
    text = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and says in text and "validate=False" not in text, result.output


def test_a_mistyped_name_gets_the_closest_choice() -> None:
    from gpipe_repro.engine.choices import did_you_mean, require_one_of
    from gpipe_repro.models import get_family

    assert did_you_mean("1fb1", ["gpipe", "1f1b"]) == "; did you mean '1f1b'?"
    assert did_you_mean("GPipe", {"gpipe", "1f1b"}) == "; did you mean 'gpipe'?"
    assert did_you_mean("resnet", ["gpipe", "1f1b"]) == ""
    with pytest.raises(ValueError, match="did you mean 'zb-h1'"):
        require_one_of("schedule", "zbh1", ["gpipe", "zb-h1"])
    with pytest.raises(ValueError, match="unknown model family 'transformr-lm'; did you mean "
                                         "'transformer-lm'"):
        get_family("transformr-lm")
