"""make validate-unseen: every row counts, with the interval its measured steps give its error."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpipe_repro.models.workload import Workload
from gpipe_repro.repro import validate_unseen as vu
from tests.calibrations import slower


def fake_run(errors: dict[tuple[int, str], tuple[float, float]], corrected_s: float = 1.0) -> Any:
    """A configuration whose measured steps scatter by +-spread around (1 + error) x simulated (1 s);
    in situ, the corrected simulation is `corrected_s`."""
    def run(workload: Workload, *, k: int, m: int, microbatch: int, checkpoint: str,
            steps: int, in_situ: bool, in_situ_m: int = 1) -> dict[str, Any]:
        error, spread = errors.get((m, checkpoint), (0.01, 0.0))
        simulated_s = 1.0
        times = [simulated_s * (1 + error + spread * (i % 3 - 1)) for i in range(8)]
        row = {"workload": workload.name, "K": k, "M": m, "microbatch": microbatch,
               "checkpoint": checkpoint, "balance": [4, 6], "step_time_s": simulated_s,
               "measured_step_time_s": sorted(times)[4], "measured_step_times_s": times,
               "relative_error": error}
        if in_situ:
            row["step_time_s"] = corrected_s
            row["in_situ"] = {"uncorrected_step_time_s": simulated_s,
                              "factors": [{"forward": 1.1, "recompute": 1.0, "backward": 1.2,
                                           "optimizer_step": 0.9}] * k}
        return row
    return run


def test_every_row_counts_and_a_wide_interval_is_inconclusive(tmp_path: Path) -> None:
    errors = {(1, "never"): (0.04, 0.0), (2, "never"): (-0.08, 0.0),
              (4, "never"): (0.02, 0.09)}           # a busy row: a wide interval, still counted
    payload = vu.main(models=["residual MLP 8x1024"], ms=[1, 2, 4], checkpoints=["never"], out=str(tmp_path),
                      command="gpipe-repro validate-unseen --models 'residual MLP 8x1024'",
                      run=fake_run(errors))
    s = payload["summary"]
    assert s["configurations"] == 3
    assert s["median_abs_error"] == pytest.approx(0.04) and s["max_abs_error"] == pytest.approx(0.08)
    # the busy row's interval reaches -7% and +11%: the median's upper bound passes 5%
    assert s["median_abs_error_bounds"] == pytest.approx([0.04, 0.08])
    assert s["verdict"] == "inconclusive"
    page = (tmp_path / "validation_unseen.md").read_text()
    assert "inconclusive" in page and "+2.0% [-7.0%" in page
    assert "gpipe-repro validate-unseen --models" in page      # not "make ..."
    assert (tmp_path / "validation_unseen.json").is_file()


def test_micro_batches_under_16_rows_are_outside_the_target() -> None:
    rows = [{"microbatch": 8, "step_time_s": 1.0, "measured_step_time_s": 1.5},
            {"microbatch": 16, "step_time_s": 1.0, "measured_step_times_s": [1.03] * 8,
             "measured_step_time_s": 1.03}]
    s = vu.summarize(rows)
    assert s["configurations"] == 1 and s["verdict"] == "met" and s["met"] is True


def test_bad_micro_batch_counts_are_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="must divide --batch-size 256"):
        vu.main(ms=[3], out=str(tmp_path), run=fake_run({}))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", list(vu.MODELS))
def test_the_unseen_models_build_as_layer_lists(name: str) -> None:
    factory, shape = vu.MODELS[name]
    work = Workload.create(name, factory, "features", shape, 10)
    layers = work.build("meta")
    assert len(layers) >= 8
    x, _ = work.sample(2, "meta")
    for layer in layers:
        x = layer(x)
    assert tuple(x.shape) == (2, 10)


def test_the_page_shows_the_uncorrected_and_the_corrected_error(tmp_path: Path) -> None:
    errors = {(1, "never"): (0.10, 0.0), (2, "never"): (-0.06, 0.0)}
    # measured 1.10 s and 0.94 s against a corrected 1.02 s: +7.8% and -7.8%
    payload = vu.main(models=["conv net 6x32 on 16x16"], ms=[1, 2], checkpoints=["never"], out=str(tmp_path),
                      run=fake_run(errors, corrected_s=1.02))
    raw, fixed = payload["summary"], payload["summary_in_situ"]
    assert raw["max_abs_error"] == pytest.approx(0.10) and raw["median_abs_error"] == pytest.approx(0.08)
    assert fixed["max_abs_error"] == pytest.approx(1.10 / 1.02 - 1)
    assert fixed["median_abs_error"] == pytest.approx(1 - 0.94 / 1.02)
    page = (tmp_path / "validation_unseen.md").read_text()
    header = next(line for line in page.splitlines() if line.startswith("| model"))
    assert "| simulated step ms" in header and "error (simulated throughput) [95% interval]" in header
    assert "in-situ corrected step ms" in header and "corrected error [95% interval]" in header
    row = next(line for line in page.splitlines() if line.startswith("| conv net") and "|   1 |" in line)
    assert "1000.0" in row and "1020.0" in row and "+10.0%" in row and "+7.8%" in row
    assert "1.10/1.00/1.20/0.90" in row                        # the factors per stage
    assert "compare it with that line): median |error| 7.8%" in page
    assert "never from the measured steps" in page
    assert "moved the median |error| from 8.0% to 7.8% and the worst from 10.0% to 7.8%" in page
    assert "--in-situ" in page
    stored = json.loads((tmp_path / "validation_unseen.json").read_text())
    assert stored["summary_in_situ"]["configurations"] == 2


def test_without_in_situ_the_page_keeps_its_columns(tmp_path: Path) -> None:
    vu.main(models=["conv net 6x32 on 16x16"], ms=[1], checkpoints=["never"], out=str(tmp_path),
            in_situ=False, run=fake_run({}))
    page = (tmp_path / "validation_unseen.md").read_text()
    assert "corrected" not in page and "+1.0%" in page


def test_rounds_calibrate_every_model_before_each_round_and_alternate_the_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round: every configuration measured once, the order reversed every other round, each
    model calibrated afresh right before its first configuration of the round; the simulated step
    is the one of the median calibration (the host drifts 10% slower a round here: the middle
    round's costs), the error pairs each round's steps with that round's simulation, the cut is the
    first's, its action durations drawn as this host's vary (a fixed variation here)."""
    from gpipe_repro.sim import platform
    from gpipe_repro.sim.calibration import calibrate
    from gpipe_repro.sim.jitter import Jitter
    from gpipe_repro.sim.own_model import predict
    from gpipe_repro.sim.partition_choice import choose_partition

    monkeypatch.setattr(platform, "measure_jitter", lambda: Jitter((0.01,), ((0.8, 1.0, 1.4),)))

    log: list[tuple[Any, ...]] = []
    base: dict[str, Any] = {}

    def fake_calibrate(workload: Workload, sizes: list[int], repeats: int) -> Any:
        if workload.name not in base:
            base[workload.name] = calibrate(workload, sizes, method="flops")
        rounds_before = sum(1 for e in log if e[0] == "calibrate" and e[1] == workload.name)
        log.append(("calibrate", workload.name, tuple(sizes), repeats))
        return slower(base[workload.name], 1.0 + 0.1 * rounds_before)

    def fake_measure(workload: Workload, balance: list[int], *, m: int, microbatch: int,
                     checkpoint: str, steps: int) -> tuple[list[float], dict[str, Any]]:
        log.append(("measure", workload.name, m, checkpoint))
        return [1.0] * steps, {"idle_fraction_before": 0.9 - 0.1 * len(log) / 100}

    seams = vu.Seams(fake_calibrate, lambda *a, **k: pytest.fail("no in-situ run asked for"), fake_measure,
                     lambda: log.append(("variation",)))
    names = ["conv net 6x32 on 16x16", "residual MLP 8x1024"]
    payload = vu.main(models=names, ms=[2, 8], checkpoints=["never"], steps=2, rounds=3, repeats=5,
                      in_situ=False, out=str(tmp_path), seams=seams)
    configs = [(n, m, "never") for n in names for m in (2, 8)]
    expected: list[tuple[Any, ...]] = [("variation",)]
    for r in range(3):
        seen: set[str] = set()
        for c in (configs if r % 2 == 0 else configs[::-1]):
            if c[0] not in seen:
                expected.append(("calibrate", c[0], (32, 128), 5))
                seen.add(c[0])
            expected.append(("measure", *c))
    assert log == expected
    assert "measured" in payload["method"] and "simulated" in payload["method"]
    rows = payload["rows"]
    assert [r["measured_step_times_s"] for r in rows] == [[1.0] * 6] * 4
    for row, (name, m, _) in zip(rows, configs):
        work = vu._workload(name)
        first = slower(base[name], 1.0)
        assert row["balance"] == choose_partition(first.partition_costs(256 // m, "never"), 2,
                                                  "bottleneck", first.uncertainty_at(256 // m))
        median = predict(work, slower(base[name], 1.1), row["balance"], m=m, microbatch=256 // m,
                         checkpoint="never", jitter=True)
        exact = predict(work, slower(base[name], 1.1), row["balance"], m=m, microbatch=256 // m,
                        checkpoint="never")
        assert row["step_time_s"] == pytest.approx(median.step_time_s, rel=1e-9)
        per_round = [predict(work, slower(base[name], x), row["balance"], m=m, microbatch=256 // m,
                             checkpoint="never", jitter=True).step_time_s for x in (1.0, 1.1, 1.2)]
        assert row["uncorrected_step_per_round_s"] == pytest.approx(per_round, rel=1e-9)
        paired = sorted(1.0 / s - 1 for s in per_round for _ in range(2))
        assert vu.row_error(row).value == pytest.approx((paired[2] + paired[3]) / 2, rel=1e-9)
        assert vu.row_error(row, paired=False).value == pytest.approx(1.0 / median.step_time_s - 1)
        # equal steps against one simulation: no spread; against each round's own: the rounds' spread
        unpaired, paired_figure = vu.row_error(row, paired=False), vu.row_error(row)
        assert unpaired.low == pytest.approx(unpaired.high)
        assert (paired_figure.low, paired_figure.high) == pytest.approx((paired[0], paired[-1]))
        assert row["step_time_s"] != pytest.approx(exact.step_time_s, rel=1e-3)
        assert row["speedup"] is None          # calibrated at the micro-batch sizes only
    page = (tmp_path / "validation_unseen.md").read_text()
    assert "In 3 rounds: each model calibrated afresh in every round right before its configurations" in page
    assert "Unpaired (all the steps against" in page and payload["summary_unpaired"]["configurations"]


def test_rounds_stop_after_the_second_where_a_third_would_not_fit_the_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_repro.sim import platform
    from gpipe_repro.sim.calibration import calibrate
    from gpipe_repro.sim.jitter import Jitter

    monkeypatch.setattr(platform, "measure_jitter", lambda: Jitter((0.01,), ((1.0,),)))
    now = [0.0]
    monkeypatch.setattr(vu.time, "monotonic", lambda: now[0])

    def fake_measure(workload: Workload, balance: list[int], *, m: int, microbatch: int,
                     checkpoint: str, steps: int) -> tuple[list[float], dict[str, Any]]:
        now[0] += 60.0                     # a round of 2 configurations: 120 s
        return [1.0] * steps, {}
    seams = vu.Seams(lambda w, sizes, repeats: calibrate(w, sizes, method="flops"),
                     lambda *a, **k: pytest.fail("no in-situ run asked for"), fake_measure, lambda: None)
    payload = vu.main(models=["conv net 6x32 on 16x16"], ms=[2, 8], checkpoints=["never"], steps=2,
                      rounds=3, repeats=5, in_situ=False, out=str(tmp_path), seams=seams, budget=300)
    assert [r["rounds"] for r in payload["rows"]] == [2, 2]
    assert [len(r["measured_step_times_s"]) for r in payload["rows"]] == [4, 4]
    assert (payload["config"]["rounds"], payload["config"]["rounds_asked"]) == (2, 3)
    page = (tmp_path / "validation_unseen.md").read_text()
    assert "In 2 rounds" in page and "(2 of the 3 rounds asked for: another would not have ended" in page
    with pytest.raises(SystemExit, match="--budget -1"):
        vu.main(models=["conv net 6x32 on 16x16"], ms=[2], rounds=3, budget=-1, seams=seams,
                out=str(tmp_path))


def test_a_slow_hours_second_round_ended_past_the_limit_of_make_results(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As validate-sim's: the second round, always started, ran past the part's limit in a slow
    hour. It now ends at the first configuration that would not end within --budget, its
    calibration counted where the configuration comes first for its model."""
    from gpipe_repro.sim import platform
    from gpipe_repro.sim.calibration import calibrate
    from gpipe_repro.sim.jitter import Jitter

    monkeypatch.setattr(platform, "measure_jitter", lambda: Jitter((0.01,), ((1.0,),)))
    now = [0.0]
    monkeypatch.setattr(vu.time, "monotonic", lambda: now[0])

    def calibrating(w: Workload, sizes: list[int], repeats: int) -> Any:
        now[0] += 30.0
        return calibrate(w, sizes, method="flops")

    def fake_measure(workload: Workload, balance: list[int], *, m: int, microbatch: int,
                     checkpoint: str, steps: int) -> tuple[list[float], dict[str, Any]]:
        now[0] += 60.0
        return [1.0] * steps, {}
    seams = vu.Seams(calibrating, lambda *a, **k: pytest.fail("no in-situ run asked for"),
                     fake_measure, lambda: None)
    payload = vu.main(models=["conv net 6x32 on 16x16"], ms=[2, 8], checkpoints=["never"], steps=2,
                      rounds=3, repeats=5, in_situ=False, out=str(tmp_path), seams=seams, budget=200)
    assert now[0] == 150.0            # round 1: 30 + 2 x 60; then 150 + 30 + 60 > 200: no more
    assert [r["rounds"] for r in payload["rows"]] == [1, 1]
    payload = vu.main(models=["conv net 6x32 on 16x16"], ms=[2, 8], checkpoints=["never"], steps=2,
                      rounds=3, repeats=5, in_situ=False, out=str(tmp_path), seams=seams, budget=250,
                      overwrite=True)
    assert [r["rounds"] for r in payload["rows"]] == [1, 2]    # round 2 runs M=8 first, then stops
    assert (payload["config"]["rounds"], payload["config"]["last_round_configurations"]) == (1, 1)
    page = (tmp_path / "validation_unseen.md").read_text()
    assert "(1 of the 3 rounds asked for, and 1 of the configurations in one more, before the next" in page


def test_validate_unseen_replaced_the_users_files_in_its_out_folder(tmp_path: Path) -> None:
    """--out DIR holding a validation_unseen.json/.md of the user's was written over without a
    word (the command had no --overwrite). It is now refused before any work, names the file, and
    changes nothing; its own earlier output is replaced only with --overwrite."""
    mine = tmp_path / "validation_unseen.json"
    mine.write_text('{"my": "numbers"}')
    ran: list[Any] = []

    def run(*args: Any, **kwargs: Any) -> dict[str, Any]:
        ran.append(args)
        return fake_run({})(*args, **kwargs)
    args: dict[str, Any] = {"models": ["residual MLP 8x1024"], "ms": [1], "checkpoints": ["never"],
                            "out": str(tmp_path), "run": run}
    with pytest.raises(SystemExit, match="not a previous `gpipe-repro validate-unseen` output"):
        vu.main(**args)
    assert mine.read_text() == '{"my": "numbers"}' and not ran
    mine.unlink()
    vu.main(**args)
    with pytest.raises(SystemExit, match="pass --overwrite"):
        vu.main(**args)
    vu.main(**args, overwrite=True)
