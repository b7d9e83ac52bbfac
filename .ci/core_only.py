"""The engine as `pip install gpipe-repro` installs it: torch and numpy, nothing else.

Run by `make test-core` in a venv holding only the project's core dependencies. It checks that

1. the venv really is core-only (none of the extras' packages can be imported), and that the
   project's core requirements are torch and numpy;
2. every module of the packages a user of the engine imports (engine, distributed, models, sim,
   memory, report, paper) imports without them;
3. a tiny pipeline trains with the local runtime (K=2) and with the distributed runtime (two stage
   processes started by `launch_local`), and the two give the same losses;
4. the `gpipe-repro` command says in one line what to install.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gpipe_repro
from gpipe_repro import GPipe
from gpipe_repro.distributed import launch_local

EXTRAS = ["typer", "rich", "matplotlib", "wandb", "transformers", "sentencepiece", "sklearn", "mlxtend",
          "datasets", "sacrebleu", "django", "pytest"]
PACKAGES = ["engine", "distributed", "models", "sim", "memory", "report", "paper"]
STEPS = 3


def check_core_only() -> None:
    present = [name for name in EXTRAS if importlib.util.find_spec(name) is not None]
    assert not present, f"this venv is not core-only: {present} can be imported"
    core = sorted(r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip()
                  for r in importlib.metadata.requires("gpipe-repro") or [] if "extra ==" not in r)
    assert core == ["numpy", "torch"], f"the core requirements are {core}, not numpy and torch"


def import_everything() -> int:
    count = 0
    for name in PACKAGES:
        module = importlib.import_module(f"gpipe_repro.{name}")
        count += 1
        for info in pkgutil.walk_packages(getattr(module, "__path__", []), f"{module.__name__}."):
            importlib.import_module(info.name)
            count += 1
    return count


def train(runtime: str) -> list[float]:
    """Three steps of a small MLP cut in two, the same data and seed in every process."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    pipe = GPipe(layers, partitions=2, micro_batches=4, runtime=runtime, loss_fn=nn.CrossEntropyLoss(),
                 optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    return [pipe.train_step(x, y) for _ in range(STEPS)]


def train_distributed() -> list[float]:
    return train("distributed")


def check_console_script() -> None:
    script = shutil.which("gpipe-repro", path=str(Path(sys.executable).parent))
    assert script is not None, "the gpipe-repro console script is not installed"
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "pip install 'gpipe-repro[cli]'" in lines[0], \
        f"gpipe-repro without typer: exit {done.returncode}, stderr {done.stderr!r}"


def main() -> None:
    start = time.perf_counter()
    check_core_only()
    print(f"core-only venv: gpipe_repro {gpipe_repro.__file__}, torch {torch.__version__}")
    print(f"imported {import_everything()} modules of {', '.join(PACKAGES)}")
    local = train("local")
    print(f"local runtime, K=2 M=4: losses {[round(v, 4) for v in local]}")
    distributed = launch_local(train_distributed, 2, job_timeout=120)
    print(f"distributed runtime, 2 processes: losses {[round(v, 4) for v in distributed[0]]}")
    assert local[-1] < local[0], f"the loss did not go down: {local}"
    for rank, losses in enumerate(distributed):
        assert losses == local, f"rank {rank}'s losses {losses} differ from the local runtime's {local}"
    check_console_script()
    print(f"gpipe-repro without typer names the extra; core-only check passed in "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
