"""`make validate-unseen`: the simulator on models it was never tuned on, run the way a user runs it.

Two compute-bound ``nn.Sequential`` models that no calibration, cost model or test of this project
was fitted to (defined below: a residual MLP of 8 pre-LayerNorm blocks of width 1024, and a plain
convolutional net on 16x16 images) go through the public path, :func:`gpipe_repro.sim.own_model.
simulate_model` (= ``gpipe-repro throughput --model module:factory``): per-layer costs calibrated on
this host with the pipeline's other core busy, the partition, the schedule simulated in virtual
time, then the same configuration run on K=2 real stage processes. Mini-batch 256, M = 1, 2, 4, 8,
16 (micro-batches of 256 down to 16 rows), checkpoint "never" and "always": 20 configurations.
Targets: median |error| <= 5%, worst <= 10% where micro-batches have >= 16 rows (all of
these). Each configuration's error carries the interval its measured steps give it, and the verdict
is met / not met / inconclusive from those intervals
(:mod:`gpipe_repro.repro.throughput.simulator_error`): a busy host widens them, no row is left out.

Results: results/throughput/validation_unseen.{md,json}.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from gpipe_repro.models.workload import Workload
from gpipe_repro.report.host import usable_cores
from gpipe_repro.report.measurement import Figure
from gpipe_repro.report.records import (
    markdown_table,
    measured,
    results_dir,
    simulated,
    write_json,
    write_markdown,
)
from gpipe_repro.repro.throughput.simulator_error import describe, error_figure, summarize_errors


class PreNormResidual(nn.Module):
    """x + f(LayerNorm(x)): a pre-norm residual block."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.body = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: Any) -> Any:
        return x + self.body(self.norm(x))


def residual_mlp(width: int = 1024, blocks: int = 8, classes: int = 10) -> nn.Sequential:
    """An unseen model: `blocks` residual MLP blocks (hidden 2 x width), a norm and a classifier."""
    return nn.Sequential(*[PreNormResidual(width, 2 * width) for _ in range(blocks)],
                         nn.LayerNorm(width), nn.Linear(width, classes))


def conv_net(channels: int = 32, blocks: int = 6, classes: int = 10) -> nn.Sequential:
    """An unseen model: 3x3 convolutions with ReLU on 3x16x16 images, pooled, then a classifier."""
    layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU())]
    layers += [nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())
               for _ in range(blocks - 1)]
    return nn.Sequential(*layers, nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()),
                         nn.Linear(channels, classes))


MODELS: dict[str, tuple[str, tuple[int, ...]]] = {
    "residual MLP 8x1024": ("gpipe_repro.repro.validate_unseen:residual_mlp", (1024,)),
    "conv net 6x32 on 16x16": ("gpipe_repro.repro.validate_unseen:conv_net", (3, 16, 16)),
}


def run_config(workload: Workload, *, k: int, m: int, microbatch: int, checkpoint: str,
               steps: int) -> dict[str, Any]:
    """One configuration the public way (calibrate, simulate, run on `k` stage processes)."""
    from gpipe_repro.sim.own_model import simulate_model
    result = simulate_model(workload, k=k, m=m, microbatch=microbatch, checkpoint=checkpoint,
                            validate=True, steps=steps)
    return result.to_json()


def row_error(row: dict[str, Any]) -> Figure:
    """A configuration's error figure, from its measured steps (or its median step alone)."""
    steps = row.get("measured_step_times_s") or [row["measured_step_time_s"]]
    return error_figure(steps, row["step_time_s"])


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst |error| with their bounds and the verdict, over the rows with micro-batches
    of >= 16 rows."""
    return summarize_errors([row_error(r).to_json() for r in rows if r["microbatch"] >= 16])


def render(payload: dict[str, Any]) -> str:
    """The markdown page."""
    def pct(x: float | None) -> str:
        return "?" if x is None else f"{x:+.1%}"

    def error(r: dict[str, Any]) -> str:
        f = row_error(r)
        return f"{pct(f.value)} [{pct(f.low)}, {pct(f.high)}]"
    body = [[r["model"], r["K"], r["M"], r["microbatch"], r["checkpoint"], str(r["balance"]),
             f"{r['measured_step_time_s'] * 1e3:.1f}", f"{r['step_time_s'] * 1e3:.1f}", error(r)]
            for r in payload["rows"]]
    table = markdown_table(["model", "K", "M", "rows/micro-batch", "checkpoint", "partition",
                            "measured step ms", "simulated step ms",
                            "error (simulated throughput) [95% interval]"], body)
    return ("# The simulator on models it was never tuned on\n\n"
            f"Over micro-batches of >= 16 rows: {describe(payload['summary'])}. Each error is the "
            "median over the measured steps with its 95% interval; "
            "the bounds of the median and the worst come from the intervals' ends (a busy host "
            "widens them).\n\n"
            f"Generated by `{payload['command']}`: each configuration run the way a user runs their own "
            "model (`gpipe-repro throughput --model module:factory ... --k 2`): calibrate on this host, "
            "partition, simulate, then run on 2 real stage processes (1 thread each) and compare. "
            "The models (`gpipe_repro/repro/validate_unseen.py`) were written for this check; no "
            "cost-model constant was fitted to them. Error = simulated throughput / measured - 1. "
            f"Measured on {payload['usable_cores']} usable cores.\n\n" + table + "\n")


def main(*, batch: int = 256, ms: Sequence[int] = (1, 2, 4, 8, 16),
         checkpoints: Sequence[str] = ("never", "always"), models: Sequence[str] = tuple(MODELS),
         steps: int = 8, out: str | None = None, command: str = "make validate-unseen",
         run: Callable[..., dict[str, Any]] = run_config) -> dict[str, Any]:
    """Run every configuration, write the results (`command`: how the page says it was made)."""
    k = 2
    if usable_cores() < k:
        raise SystemExit(f"validation runs K={k} stage processes on one core each; this host has "
                         f"{usable_cores()} usable core(s)")
    bad = [m for m in ms if m < 1 or batch % m]
    if bad:
        raise SystemExit(f"--ms {bad}: every M must divide --batch-size {batch}")
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        raise SystemExit(f"--models {unknown}: the models are {', '.join(map(repr, MODELS))}")
    rows = []
    for name in models:
        factory, shape = MODELS[name]
        workload = Workload.create(name, factory, "features", shape, 10)
        for checkpoint in checkpoints:
            for m in ms:
                print(f"{name}: K={k} M={m} checkpoint={checkpoint}", flush=True)
                row = run(workload, k=k, m=m, microbatch=batch // m, checkpoint=checkpoint,
                          steps=steps)
                row["model"] = name
                print(f"  simulated {row['step_time_s'] * 1e3:.1f} ms, measured "
                      f"{row['measured_step_time_s'] * 1e3:.1f} ms; error {row_error(row).cell()}",
                      flush=True)
                rows.append(row)
    config = {"batch": batch, "ms": list(ms), "checkpoints": list(checkpoints), "models": list(models),
              "steps": steps, "out": out}
    payload = {"experiment": "simulator vs real runs on models it was never tuned on",
               "command": command, "config": config, "usable_cores": usable_cores(), "rows": rows,
               "summary": summarize(rows)}
    folder = results_dir("throughput") if out is None else _own_folder(out)
    write_json(folder / "validation_unseen.json", {
        **payload, "step_time_s": {f"{r['model']}/{r['checkpoint']}/M{r['M']}": {
            "measured": measured(r["measured_step_time_s"], unit="s"),
            "simulated": simulated(r["step_time_s"], unit="s")} for r in rows}})
    text = render(payload)
    write_markdown(folder / "validation_unseen.md", text)
    print(text)
    return payload


def _own_folder(path: str) -> Path:
    """An output directory of the user's choosing (created; only the two result files are written)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
