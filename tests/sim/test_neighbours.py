"""A calibration's busy-neighbour processes never outlive it: killed before it could stop them, the
calibrating process takes them with it (they were found training on forever, orphaned, and making
every later measurement on the host read "busy")."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CALIBRATING = textwrap.dedent("""
    import multiprocessing as mp
    import time
    from gpipe_repro.models.workload import Workload
    from gpipe_repro.sim.calibration.neighbours import busy_neighbours
    if __name__ == "__main__":
        w = Workload.create("m", "gpipe_repro.repro.validate_unseen:residual_mlp", "features", (16,),
                            10, width=16, blocks=1)
        with busy_neighbours(w, 4, 1):
            print(" ".join(str(p.pid) for p in mp.active_children()), flush=True)
            time.sleep(600)
""")


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_killed_calibration_takes_its_busy_neighbours_with_it(tmp_path: Path) -> None:
    script = tmp_path / "calibrating.py"
    script.write_text(CALIBRATING)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and all(_running(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    _assert_gone(pids, "their calibration")


def _assert_gone(pids: list[int], what: str) -> None:
    """Every process of `pids` ends within 2 minutes (each neighbour checks its parent every training
    step; the guard only catches one that never stops, and kills it)."""
    guard = time.monotonic() + 120
    while any(_running(p) for p in pids) and time.monotonic() < guard:
        time.sleep(0.1)
    left = [p for p in pids if _running(p)]
    for p in left:
        os.kill(p, 9)
    assert not left, f"busy neighbours {left} outlived {what}"


DIES_STARTING = textwrap.dedent("""
    import multiprocessing as mp
    import os
    import threading
    import time
    from gpipe_repro.models.workload import Workload
    from gpipe_repro.sim.calibration.neighbours import busy_neighbours

    def die_soon():
        while not mp.active_children():
            time.sleep(0.01)
        time.sleep(0.3)            # the neighbour still imports torch and builds its model
        print(" ".join(str(p.pid) for p in mp.active_children()), flush=True)
        os._exit(0)

    if __name__ == "__main__":
        w = Workload.create("m", "gpipe_repro.repro.validate_unseen:residual_mlp", "features", (16,),
                            10, width=16, blocks=1)
        threading.Thread(target=die_soon, daemon=True).start()
        with busy_neighbours(w, 4, 1):
            time.sleep(600)
""")


def test_a_calibration_killed_while_its_neighbour_started_takes_it_along(tmp_path: Path) -> None:
    """A neighbour read its parent's pid after its imports and its model build: where the
    calibrating process was killed meanwhile, it read its new parent's (init's) and trained on
    forever (one was found at 92% of a core an hour later, slowing every measurement). The parent's
    pid now comes from the parent."""
    script = tmp_path / "dies_starting.py"
    script.write_text(DIES_STARTING)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]   # (a neighbour holds the pipe open)
    proc.wait(timeout=60)
    assert pids
    _assert_gone(pids, "a calibration killed while they started")
