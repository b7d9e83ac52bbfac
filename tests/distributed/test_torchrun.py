"""`torchrun --nproc-per-node 2` runs the same pipeline code as the local launcher."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_trains_and_rank0_writes_the_timeline(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.json"
    beside = Path(sys.executable).parent / "gpipe-repro"     # the venv's entry point, as a user has it
    cli = str(beside) if beside.exists() else shutil.which("gpipe-repro")
    assert cli, "the gpipe-repro command is not installed (pip install -e .)"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           cli, "pipeline", "--launcher", "torchrun", "--steps", "2", "--batch", "64",
           "--width", "32", "--blocks", "2", "--micro-batches", "4", "--timeout", "20",
           "--timeline", str(timeline)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "losses" in done.stdout
    saved = json.loads(timeline.read_text())
    assert saved["method"] == "measured" and saved["timeline"]["num_stages"] == 2
    stages = {e["stage"] for e in saved["timeline"]["events"]}
    assert stages == {0, 1}
