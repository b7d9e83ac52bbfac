"""`make results`'s driver in a tiny mode: the plan, the dirty-tree refusal, the order, the stamps, and
a part that fails or runs out of time (recorded, the run goes on). Parts here are one-line Python
children writing into a throwaway git checkout's results/; the real plan is checked, not run."""
from __future__ import annotations

import io
import json
import socket
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from experiments import results as driver
from experiments.result_stamps import png_texts, read_stamp
from experiments.timed_parts import Part, check_parts, plan_lines


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def _png() -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00\x00"))
            + chunk(b"IEND", b""))


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "results" / "alpha").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    (repo / "results" / "alpha" / "old.md").write_text("# old\n")
    (repo / "results" / "alpha" / "figure.png").write_bytes(_png())
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "start")
    return repo


def _writer(name: str, folder: str, extra: str = "") -> Part:
    """A part that logs its name, then writes a JSON and a markdown file (and re-draws a PNG)."""
    code = (
        "import json, os, pathlib, sys\n"
        "root = pathlib.Path(os.environ['GPIPE_REPRO_RESULTS'])\n"
        f"(root / 'order.log').open('a').write('{name}\\n')\n"
        f"out = root / '{folder}'; out.mkdir(exist_ok=True)\n"
        f"(out / '{name}.json').write_text(json.dumps({{'value': 1}}))\n"
        f"(out / '{name}.md').write_text('# {name}\\n')\n"
        f"{extra}\n"
        "print('done', flush=True)\n")
    return Part(name, (sys.executable, "-c", code), 60, (folder,))


def test_the_plan_fits_45_minutes_and_each_benchmark_budget_fits_its_limit() -> None:
    check_parts(driver.PARTS, driver.TOTAL_LIMIT_S)
    names = [p.name for p in driver.PARTS]
    assert names.index("throughput-table") < names.index("validate-sim")   # validate-sim re-renders it
    assert {"throughput-table", "validate-sim", "memory-table", "bench-overhead", "bench-runtime",
            "bench-schedules", "bench-replicas", "check-regression-detector"} <= set(names)
    for part in driver.PARTS:
        if "--budget" in part.argv:
            assert float(part.argv[part.argv.index("--budget") + 1]) < part.limit_s
    lines = plan_lines(driver.PARTS, driver.TOTAL_LIMIT_S)
    assert len(lines) == len(driver.PARTS) + 1 and "of the 2700 s allowed" in lines[-1]


def test_dry_run_prints_the_plan_and_runs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    driver.main(dry_run=True)
    printed = capsys.readouterr().out
    assert all(p.name in printed for p in driver.PARTS) and "total" in printed


def test_a_plan_over_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="add up to"):
        check_parts([Part("a", ("true",), 30), Part("b", ("true",), 31)], 60)


def test_a_dirty_tree_is_refused_before_any_part_runs(checkout: Path) -> None:
    (checkout / "code.py").write_text("x = 2\n")
    with pytest.raises(driver.DirtyCheckout, match=r"dirty tree.*code\.py"):
        driver.regenerate([_writer("one", "alpha")], repo=checkout, results=checkout / "results",
                          out=io.StringIO())
    assert not (checkout / "results" / "order.log").exists()


def test_changed_results_do_not_make_the_tree_dirty(checkout: Path) -> None:
    (checkout / "results" / "alpha" / "old.md").write_text("# changed by an earlier run\n")
    assert driver.require_clean(checkout) == _git(checkout, "rev-parse", "HEAD")


def test_parts_run_in_order_and_every_file_they_wrote_is_stamped(checkout: Path) -> None:
    results = checkout / "results"
    redraw = "(out / 'figure.png').write_bytes((out / 'figure.png').read_bytes())"
    parts = [_writer("one", "alpha", redraw), _writer("two", "beta"), _writer("three", "alpha")]
    out = io.StringIO()
    manifest = driver.regenerate(parts, repo=checkout, results=results, out=out)
    assert (results / "order.log").read_text().split() == ["one", "two", "three"]
    commit = _git(checkout, "rev-parse", "HEAD")
    stamp = read_stamp(results / "beta" / "two.json")
    assert stamp is not None and stamp["commit"] == commit and stamp["hostname"] == socket.gethostname()
    assert stamp["part"] == "two" and stamp["command"] == driver.COMMAND
    assert json.loads((results / "beta" / "two.json").read_text())["value"] == 1     # content kept
    md = (results / "alpha" / "one.md").read_text()
    assert md.startswith("# one") and commit[:12] in md.splitlines()[-1]
    png = png_texts((results / "alpha" / "figure.png").read_bytes())
    assert json.loads(png["regenerated"])["part"] == "one"
    assert read_stamp(results / "alpha" / "old.md") is None          # not written: not stamped
    assert [p["status"] for p in manifest["parts"]] == ["ok", "ok", "ok"]
    assert set(manifest["files"]) == {"alpha/one.json", "alpha/one.md", "alpha/figure.png",
                                      "beta/two.json", "beta/two.md", "alpha/three.json", "alpha/three.md"}
    assert json.loads((results / driver.MANIFEST).read_text())["commit"] == commit
    assert "results 2/3 two: ok" in out.getvalue()


def test_a_markdown_stamp_is_replaced_not_repeated(checkout: Path) -> None:
    results = checkout / "results"
    driver.regenerate([_writer("one", "alpha")], repo=checkout, results=results, out=io.StringIO())
    md = results / "alpha" / "one.md"
    from experiments.result_stamps import stamp_file
    stamp_file(md, {"command": "c", "part": "p", "commit": "abc", "hostname": "h", "cpu": "c",
                    "cores": 1, "time_utc": "t"})
    assert md.read_text().count("_Regenerated by ") == 1


def test_a_failing_or_slow_part_is_recorded_and_the_run_goes_on(checkout: Path) -> None:
    fail = Part("fail", (sys.executable, "-c", "raise SystemExit(3)"), 30)
    slow = Part("slow", (sys.executable, "-c", "import time; time.sleep(60)"), 1.5)
    out = io.StringIO()
    manifest = driver.regenerate([fail, slow, _writer("after", "alpha")], repo=checkout,
                                 results=checkout / "results", out=out, progress_every=0.5)
    statuses = {p["name"]: (p["status"], p["returncode"]) for p in manifest["parts"]}
    assert statuses["fail"] == ("failed", 3)
    assert statuses["slow"][0] == "timed out"
    assert statuses["after"][0] == "ok"
    assert "slow: running" in out.getvalue()          # a progress line while the part was silent


def test_a_file_written_before_its_part_timed_out_says_so_in_its_stamp(checkout: Path) -> None:
    results = checkout / "results"
    late = _writer("late", "alpha", "import time; time.sleep(60)")
    late = Part(late.name, late.argv, 4.0, late.outputs)
    driver.regenerate([late, _writer("fine", "beta")], repo=checkout, results=results, out=io.StringIO())
    assert "late, the part timed out after writing this file)" in (results / "alpha" / "late.md").read_text()
    stamp = read_stamp(results / "alpha" / "late.json")
    assert stamp is not None and stamp["part_status"] == "timed out"
    assert "(fine)" in (results / "beta" / "fine.md").read_text().splitlines()[-1]


def test_only_some_parts_replace_their_entries_in_the_manifest(checkout: Path) -> None:
    """`make results ONLY=...` reruns a part that ran out of time: the other parts' entries and
    files stay, each part names the commit it ran at."""
    results = checkout / "results"
    driver.regenerate([_writer("one", "alpha"), _writer("two", "beta")], repo=checkout, results=results,
                      out=io.StringIO())
    (checkout / "code.py").write_text("x = 2\n")
    _git(checkout, "commit", "-qam", "next")
    driver.regenerate([_writer("two", "beta")], repo=checkout, results=results, out=io.StringIO(), merge=True)
    manifest = json.loads((results / driver.MANIFEST).read_text())
    commits = {p["name"]: p["commit"] for p in manifest["parts"]}
    assert set(commits) == {"one", "two"} and commits["one"] != commits["two"]
    assert commits["two"] == manifest["commit"] == _git(checkout, "rev-parse", "HEAD")
    assert sorted(manifest["commits"]) == sorted(set(commits.values()))
    assert {f: v["part"] for f, v in manifest["files"].items()} == {
        "alpha/one.json": "one", "alpha/one.md": "one", "beta/two.json": "two", "beta/two.md": "two"}
    with pytest.raises(ValueError, match="unknown part.*bogus"):
        driver.chosen(["bogus"])
    assert [p.name for p in driver.chosen(["validate-sim", "throughput-table"])] == ["throughput-table",
                                                                                      "validate-sim"]


def test_pages_of_record_outside_the_45_minutes_run_stamped_when_named() -> None:
    """versus_torch.md and zero_bubble.md were written by their own targets without the commit and
    host stamp every other page carries: named, `make results ONLY=...` runs and stamps them."""
    full = [p.name for p in driver.chosen([])]
    assert "versus-torch" not in full and "bench-zero-bubble" not in full
    assert [p.name for p in driver.chosen(["versus-torch", "bench-schedules"])] == ["bench-schedules",
                                                                                    "versus-torch"]
    for part in driver.ON_REQUEST:
        check_parts([part], driver.TOTAL_LIMIT_S)
        module = part.argv[part.argv.index("-m") + 1]
        assert (Path(__file__).resolve().parents[2] / (module.replace(".", "/") + ".py")).is_file()
        if "--budget" in part.argv:
            assert float(part.argv[part.argv.index("--budget") + 1]) < part.limit_s
