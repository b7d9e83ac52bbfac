"""`torchrun --nproc-per-node 2` runs the same pipeline code as the local launcher."""
from __future__ import annotations

import json
import re
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
    # "--": the rest is the script's (torchrun's own parser would take --m for an abbreviation of its options)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--",
           cli, "pipeline", "--launcher", "torchrun", "--steps", "2", "--batch-size", "64",
           "--width", "32", "--blocks", "2", "--m", "4", "--timeout", "20",
           "--timeline", str(timeline)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "losses" in done.stdout
    saved = json.loads(timeline.read_text())
    assert saved["method"] == "measured" and saved["timeline"]["num_stages"] == 2
    stages = {e["stage"] for e in saved["timeline"]["events"]}
    assert stages == {0, 1}


ENDLESS = """
import os, sys, time
import torch
from torch import nn
from gpipe_repro import GPipe
from gpipe_repro.distributed import stage_main

def train():
    torch.manual_seed(0)
    pipe = GPipe([nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)], partitions=2, micro_batches=2,
                 runtime="distributed", loss_fn=nn.CrossEntropyLoss(),
                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    print(f"worker {os.getpid()} training", flush=True)
    while True:
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 2, (4,)))
        time.sleep(0.01)

if __name__ == "__main__":
    stage_main(train)
"""


def test_workers_end_when_torchrun_is_killed(tmp_path: Path) -> None:
    """torchrun killed with SIGKILL (the OOM killer, a scheduler's hard stop) cannot stop its workers;
    they notice their parent is gone (process_group.watch_parent) and end within seconds instead of
    training on as orphans."""
    import os
    import signal
    import time

    from tests.distributed.test_faults import alive
    script = tmp_path / "endless.py"
    script.write_text(ENDLESS)
    log = (tmp_path / "out.txt").open("w")
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "2", str(script)], stdout=log, stderr=subprocess.STDOUT,
                           cwd=ROOT)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.5)
            # two processes write to one file: their lines may interleave ("worker 1 trainingworker 2")
            workers = [int(pid) for pid in re.findall(r"worker (\d+) training",
                                                      (tmp_path / "out.txt").read_text())]
        assert len(workers) == 2, (tmp_path / "out.txt").read_text()[-2000:]
        job.send_signal(signal.SIGKILL)
        job.wait()

        deadline = time.monotonic() + 30
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in workers), "workers outlived torchrun"
        assert "is gone, stopping" in (tmp_path / "out.txt").read_text()
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if job.poll() is None:
            job.kill()
