"""`make bench-latency`: how long two user-facing commands take, against their targets.

- ``gpipe-repro fit`` on Transformer-1663 (83.9B parameters, Table 1's Pipeline-128: K=128, M=8,
  16 GB per device) in a fresh process: target 60 s, and its peak resident memory (target 2 GiB;
  the test suite checks the memory, tests/commands/test_memory.py, but not the time);
- an offline W&B run (init, 3 logged steps, a table, a summary, finish) through
  :class:`~gpipe_repro.report.wandb_log.RunLogger`, in a fresh process whose W&B settings and home
  are a temporary directory (nothing of the user's W&B setup is read or written): target 30 s.

Each line prints the seconds, the ratio to the target (<= 1 meets it) and the host's load average
and idle fraction just before, so a number taken on a busy host says so. Nothing is written under
results/: these are checks of a host, not results of record.
"""
from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer

from gpipe_repro.report.host import HostWatch, busy_note

FIT_ARGS = ["fit", "transformer-lm", "--L", "1663", "-K", "128", "-M", "8", "--memory", "16"]
FIT_TARGET_S, FIT_TARGET_RSS = 60.0, 2 * 2 ** 30
WANDB_TARGET_S = 30.0

_CLI = "import sys; from gpipe_repro.cli import main; sys.argv = ['gpipe-repro'] + sys.argv[1:]; main()"
_WANDB_RUN = """
import json, sys, time
from pathlib import Path
from gpipe_repro.report.wandb_log import RunLogger
start = time.perf_counter()
logger = RunLogger("gpipe-repro-bench", {"K": 2, "M": 4}, dir=Path(sys.argv[1]), mode="offline")
for step in range(3):
    logger.log({"loss": 1.0 / (step + 1)}, step=step)
logger.log_table("t", ["a"], [[1]])
logger.summary({"final": 0.25})
logger.finish()
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def time_fit(timeout_s: float) -> dict[str, Any]:
    """`gpipe-repro fit` of the 80B Transformer in a fresh process: seconds, peak RSS, parameters."""
    with HostWatch() as watch:       # idle before, other processes' CPU during
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _CLI, *FIT_ARGS], capture_output=True, text=True,
                             timeout=timeout_s)
        seconds = time.perf_counter() - t0
    host = watch.conditions
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024   # Linux: KiB
    if out.returncode != 0:
        raise RuntimeError(f"gpipe-repro {' '.join(FIT_ARGS)} failed:\n{out.stderr[-2000:]}")
    found = re.search(r"([\d,]+) parameters", out.stdout)
    params = int(found.group(1).replace(",", "")) if found else None
    return {"seconds": seconds, "peak_rss_bytes": rss, "parameters": params, "host": host}


def time_offline_wandb(timeout_s: float) -> dict[str, Any]:
    """An offline W&B run in a fresh process, its W&B home a temporary directory: seconds of
    init-to-finish (the import of wandb included, the start of Python not)."""
    with HostWatch() as watch, tempfile.TemporaryDirectory(prefix="gpipe-bench-wandb-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
        env.update({"HOME": str(Path(tmp) / "home"), "WANDB_CONFIG_DIR": str(Path(tmp) / "wandb-home"),
                    "WANDB_CACHE_DIR": str(Path(tmp) / "wandb-home"),
                    "WANDB_DATA_DIR": str(Path(tmp) / "wandb-home")})
        out = subprocess.run([sys.executable, "-c", _WANDB_RUN, str(Path(tmp) / "run")], env=env,
                             capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"the offline W&B run failed:\n{out.stderr[-2000:]}")
    return {"seconds": float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"]),
            "host": watch.conditions}


def _line(name: str, value: float, target: float, unit: str, host: dict[str, Any]) -> str:
    return (f"{name:<34} {value:10.1f} {unit:<4} target {target:6.1f}  ratio {value / target:5.2f}  "
            f"load {host['load_average_before']:.2f} idle {host['idle_fraction_before']:.0%}"
            f"{busy_note(host)}")


app = typer.Typer(add_completion=False)


@app.command()
def main(timeout: float = typer.Option(600.0, "--timeout", min=1.0,
                                     help="seconds before a run is abandoned")) -> None:
    """Run both timings and print one line each (seconds, target, ratio, host load)."""
    fit = time_fit(timeout)
    wandb = time_offline_wandb(timeout)
    print(_line("fit Transformer-1663 (83.9B), wall", fit["seconds"], FIT_TARGET_S, "s", fit["host"]))
    print(_line("fit Transformer-1663, peak RSS", fit["peak_rss_bytes"] / 2 ** 30, FIT_TARGET_RSS / 2 ** 30,
                "GiB", fit["host"]))
    print(_line("offline W&B run, init to finish", wandb["seconds"], WANDB_TARGET_S, "s", wandb["host"]))


if __name__ == "__main__":
    app()
