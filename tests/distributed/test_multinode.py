"""Two torchrun "nodes" on one host form one K=2 x R=2 job (c10d rendezvous on 127.0.0.1), and a
process killed on the second node ends the whole job, the rank and node named.

Both invocations are exactly the two-host command of docs/distributed.md with the rendezvous endpoint on
127.0.0.1. How the job ends is asserted, not how fast: every surviving rank fails by itself with a
PeerFailure naming the peer or group it lost (a dead peer shows as a closed connection at once, a
silent one after the communication timeout, 5 s here), and torchrun ends each node. No clock is
read; the only time limit is a hang guard (HANG_S), far beyond any healthy ending on a loaded host.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpipe_repro.distributed.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 5.0
HANG_S = 240.0


def _start_nodes(port: int, extra: list[str]) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPIPE_REPRO_TIMEOUT_S": str(TIMEOUT),
           "OMP_NUM_THREADS": "1"}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--local-addr", "127.0.0.1", "--max-restarts", "0",
               # 1 s: a node's agent stops its other workers once it sees one die; the survivors
               # must first detect the loss themselves (a closed connection: milliseconds, unless
               # a loaded host keeps them off the CPU), which a 0.2 s interval raced under load.
               "--monitor-interval", "1",
               str(ROOT / "experiments" / "replicas_job.py"), "--k", "2", *extra]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    return procs


def _finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:   # never leave a torchrun behind
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return out


@pytest.mark.slow
def test_two_nodes_form_one_job_and_a_kill_on_the_second_ends_it(tmp_path: Path) -> None:
    """Steps 0 and 1 run on all 4 ranks of both nodes; at step 2 rank 3 (node 1) is killed."""
    stamp = tmp_path / "killed_at"
    # rank 3 is on the node whose group rank is 1 (2 processes per node: rank = node * 2 + local rank)
    procs = _start_nodes(free_port(), ["--steps", "4", "--kill-rank", "3", "--kill-step", "2",
                                       "--stamp", str(stamp)])
    results = _finish(procs, timeout=HANG_S)      # a hang raises TimeoutExpired here
    assert stamp.exists(), "the fault was never injected: " + results[1][2][-3000:]
    assert all(code != 0 for code, _, _ in results), "both nodes must fail"
    stderr = "".join(err for _, _, err in results)
    # Each survivor detected the loss itself: ranks 0 and 1 in their data-parallel group with rank 3's
    # replica partner, rank 2 from its pipeline neighbour rank 3.
    for rank in (0, 1, 2):
        mine = "\n".join(line for line in stderr.splitlines() if f"rank {rank}" in line)[-3000:]
        assert re.search(rf"rank {rank} failed: PeerFailure: rank {rank} lost", stderr), (
            f"rank {rank} did not report losing a peer; its lines:\n{mine}\n---\n{stderr[-2000:]}")
    assert "lost rank 3" in stderr, stderr[-4000:]
    stdout = "".join(out for _, out, _ in results)
    assert re.search(r"step 1 loss \d+\.\d+ over 4 ranks", stdout), stdout
    assert all(f"rank {r} = node" in stderr for r in range(4)) and "x R=2" in stderr
    assert "rank 3 = node 1 local rank 1" in stderr, stderr[-3000:]
    # torchrun's report on the second node names the killed rank and its signal
    assert re.search(r"rank\s*:\s*3 \(local_rank\s*:\s*1\)", stderr), stderr[-4000:]
    assert "SIGKILL" in stderr or "Signal 9" in stderr, stderr[-4000:]
