"""Probe: per-micro-batch cost of the headline model on a GPU, engine against plain PyTorch.

`gpipe-repro run amoebanet --k 4 --m 32 --device cuda` trains AmoebaNet-B (3, 16) on 28x28 MNIST
with micro-batches of 8 examples: far too little work per kernel for a GPU, so a step costs what
its kernel launches cost. This probe says how much of that is the engine: it times, on one device,
a plain full-batch step, a plain gradient-accumulation loop over the same M=32 micro-batches, and
GPipe at K=1/K=4, M=1/M=32 (all cells on the one device, so the K cells run one after another).

    python -m experiments.probe_gpu_microbatches --device cuda:0 [--write | --out PATH]

It prints a console table. With ``--write`` it also writes the rows as a measured record to
results/gpu/<device>/probe_gpu_microbatches.json (the device's gpu-check directory), with ``--out``
to PATH. An existing file is replaced only with ``--overwrite``; that is checked before any work.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import typer

from gpipe_repro import GPipe
from gpipe_repro.models.amoebanet import amoebanet, amoebanet_loss
from gpipe_repro.report.provenance import git_state
from gpipe_repro.report.records import results_root, write_json
from gpipe_repro.repro.gpu_check.settings import device_info, device_slug

EXPERIMENT = "probe-gpu-microbatches"
FILE_NAME = "probe_gpu_microbatches.json"
_DEFAULT = "<default>"   # --write: the default path


def build() -> torch.nn.Sequential:
    """AmoebaNet-B (3, 16) for 28x28 one-channel images, 10 classes (the headline model)."""
    torch.manual_seed(0)
    return amoebanet(3, 16, "B", 10, in_channels=1, dropout=0.2, drop_path=0.1, aux_head=True,
                     image_size=28)


def timed(step: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> float:
    """Seconds per call of `step`: `warmup` calls, then the mean of `steps` (device synchronized)."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / steps


def baseline_name(m: int) -> str:
    """The row every other row is compared with: plain PyTorch accumulating over M micro-batches."""
    return f"plain, {m} micro-batches accumulated"


def measure(device: torch.device, *, batch: int, m: int, steps: int, warmup: int) -> dict[str, float]:
    """Seconds per training step of each configuration, in the console table's order."""
    x = torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    rows: dict[str, float] = {}

    model = build().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def plain(parts: int) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad()
            for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
                (amoebanet_loss(model(xs), ys) * len(ys) / len(y)).backward()
            opt.step()
        return step

    rows["plain, full batch"] = timed(plain(1), device, warmup, steps)
    rows[baseline_name(m)] = timed(plain(m), device, warmup, steps)
    for k, mb, mode in ((1, 1, "never"), (1, m, "never"), (4, m, "never"), (4, m, "except_last"),
                        (4, m, "always")):
        pipe = GPipe(build(), partitions=k, micro_batches=mb, checkpoint=mode, devices=[device] * k,
                     loss_fn=amoebanet_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
        rows[f"GPipe K={k} M={mb} checkpoint={mode}"] = timed(_train_step_of(pipe, x, y), device,
                                                               warmup, steps)
    return rows


def _train_step_of(pipe: GPipe, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    return lambda: pipe.train_step(x, y)


def payload(rows: dict[str, float], *, device: torch.device, m: int, config: dict[str, Any],
            load_before: Sequence[float], load_after: Sequence[float]) -> dict[str, Any]:
    """The JSON record of one probe: measured seconds per step and the ratio to the baseline row,
    with the device, torch version, commit and host load averages before and after."""
    info = device_info(device)
    base = rows[baseline_name(m)]
    git = git_state()
    return {"experiment": EXPERIMENT, "method": "measured",
            "device": info.get("name") or str(device), "torch": torch.__version__,
            "commit": git["git_commit"], "git_dirty": git["git_dirty"],
            "host": {"load_average_before": list(load_before), "load_average_after": list(load_after)},
            "config": {**config, "device": str(device)}, "baseline": baseline_name(m),
            "rows": [{"configuration": name, "ms_per_step": s * 1e3, "vs_baseline": s / base}
                     for name, s in rows.items()]}


def json_path(option: str | None, device: torch.device, root: str | Path | None = None) -> Path | None:
    """Where the record goes: None without one, PATH when given, else results/gpu/<device>/ (results/
    is `root`, else $GPIPE_REPRO_RESULTS, else ./results)."""
    if option is None:
        return None
    if option == _DEFAULT:
        base = Path(root) if root is not None else results_root()
        return base / "gpu" / device_slug(device_info(device)) / FILE_NAME
    return Path(option)


def check_json_path(path: Path, *, overwrite: bool) -> None:
    """Refuse a path that is a directory, or an existing file without ``--overwrite`` (before work)."""
    if path.is_dir():
        raise SystemExit(f"--out {path} is a directory: give a file path, e.g. {path / FILE_NAME}")
    if path.exists() and not overwrite:
        raise SystemExit(f"--out {path} exists: pass --overwrite to replace it, or give another path "
                         "(nothing was touched)")


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise SystemExit(f"--device {name!r} is not a device torch knows ({e}): use cuda:0 or cpu") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch {torch.__version__} sees no CUDA GPU here; run it on "
                         "a GPU host (or --device cpu for a smoke run)")
    return device


app = typer.Typer(add_completion=False)


@app.command()
def main(device: str = typer.Option("cuda:0", "--device", help="the device to time on (cpu: a smoke run)"),
         batch: int = typer.Option(256, "--batch-size", min=1, help="examples per step"),
         m: int = typer.Option(32, "--m", min=1, help="micro-batches (and the plain loop's parts)"),
         steps: int = typer.Option(8, "--steps", min=1, help="timed steps of each configuration"),
         warmup: int = typer.Option(3, "--warmup", min=0, help="untimed steps before them"),
         write: bool = typer.Option(False, "--write", help=f"also write the rows to results/gpu/<device>/"
                                    f"{FILE_NAME}"),
         out: Path | None = typer.Option(None, "--out", help="also write the rows to this JSON file"),
         overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing record")) -> None:
    """Time every configuration, print the table (and write the record if asked)."""
    if m > batch:
        raise typer.BadParameter(f"--m {m} is larger than --batch-size {batch}: use --m <= --batch-size")
    torch_device = _device(device)
    path = json_path(str(out) if out is not None else _DEFAULT if write else None, torch_device)
    if path is not None:
        check_json_path(path, overwrite=overwrite)

    load_before = os.getloadavg()
    rows = measure(torch_device, batch=batch, m=m, steps=steps, warmup=warmup)
    load_after = os.getloadavg()
    base = rows[baseline_name(m)]
    print(f"{'configuration':<42} {'ms/step':>9} {'vs plain M=' + str(m):>14}")
    for name, s in rows.items():
        print(f"{name:<42} {s * 1e3:9.1f} {s / base:14.2f}")
    env = {"device": torch.cuda.get_device_name(torch_device) if torch_device.type == "cuda" else "cpu",
           "torch": torch.__version__, "load_average": os.getloadavg()}
    print(json.dumps({"env": env, "seconds_per_step": rows}))
    if path is not None:
        record = payload(rows, device=torch_device, m=m, load_before=load_before, load_after=load_after,
                         config={"batch": batch, "m": m, "steps": steps, "warmup": warmup})
        write_json(path, record)
        print(f"wrote {path}")


if __name__ == "__main__":
    app()
