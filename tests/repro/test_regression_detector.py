"""The detector's results file (experiments/check_regression_detector.py) carries its label and its
host block. No detector run here (each takes minutes): a made-up run goes through the real writer."""
from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from experiments import check_regression_detector as rd
from gpipe_repro.report.provenance import host_block
from gpipe_repro.report.records import read_json, write_json


def _run(passed: bool) -> dict:
    return {"passed": passed, "returncode": 0 if passed else 1, "tests": {"test_x": "passed"},
            "values": {"overlap": 0.8}, "seconds": 1.0, "load_average": [0.5, 0.7], "tail": ""}


def test_the_results_file_says_measured_and_where(tmp_path: Path) -> None:
    conditions = [rd.HEALTHY, "one core"]
    payload = rd._payload(1, conditions, {rd.HEALTHY: [_run(True)], "one core": [_run(False)]},
                          host_block(idle_fraction_before=0.95))
    payload["summary"] = rd.summarize(payload)
    data = read_json(write_json(tmp_path / "regression_detector.json", payload))
    assert data["method"] == "measured"
    host = data["host"]
    assert host["usable_cores"] >= 1 and len(host["load_average"]) == 3
    assert len(host["load_average_end"]) == 3 and host["idle_fraction_before"] == 0.95
    assert "git_commit" in host and "git_dirty" in host and "environment" in data
    page = rd.render(data)
    assert "load " in page and "at the end" in page and "Verdict: every healthy run passed" in page
    assert f"Measured by `make check-regression-detector` on {data['environment']['device']}" in page
    # A file written before the host block existed still renders.
    old = {**data, "host": {"usable_cores": 2, "idle_fraction_before": 0.0}}
    assert "2 usable cores)" in rd.render(old)


def test_every_mutation_still_applies_to_the_tree() -> None:
    """`make check-regression-detector` applies each mutation to a copy of the tree; a refactor
    that moves the mutated line would make it refuse to run, so each pattern must match exactly
    once in the current source (a stale 'schedule serialized' pattern went unnoticed until a rerun)."""
    import re

    for m in rd.MUTATIONS:
        text = (rd.ROOT / m.path).read_text()
        assert len(re.findall(m.pattern, text, flags=re.MULTILINE)) == 1, (m.name, m.path)


def test_render_only_writes_the_page_again_from_its_json(tmp_path: Path) -> None:
    """`make check-regression-detector RENDER_ONLY=1`: the page from the recorded JSON, no run; the
    JSON is untouched and the page says measured, and on which device."""
    import shutil

    record = Path(__file__).resolve().parents[2] / "results" / "ci" / "regression_detector.json"
    shutil.copy(record, tmp_path / "regression_detector.json")
    before = (tmp_path / "regression_detector.json").read_bytes()
    result = CliRunner().invoke(rd.app, ["--render-only", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "regression_detector.md").read_text()
    assert page.startswith("# Does the CI") and "Measured by `make check-regression-detector` on " in page
    assert (tmp_path / "regression_detector.json").read_bytes() == before


def test_the_detector_overwrote_a_users_file_at_its_out(tmp_path: Path) -> None:
    """`check-regression-detector --out DIR` wrote its JSON and page over whatever DIR held (it had
    no output check). A file it did not write is refused before any run, and kept."""
    (tmp_path / "regression_detector.json").write_text('{"mine": true}')
    (tmp_path / "regression_detector.md").write_text("my notes")
    for args in ([], ["--render-only"]):
        result = CliRunner().invoke(rd.app, [*args, "--out", str(tmp_path), "--runs", "1"])
        assert result.exit_code != 0 and "not a previous" in result.output, result.output
    assert (tmp_path / "regression_detector.md").read_text() == "my notes"
    assert (tmp_path / "regression_detector.json").read_text() == '{"mine": true}'
