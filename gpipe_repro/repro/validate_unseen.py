"""`make validate-unseen`: the simulator on models it was never tuned on, run the way a user runs it.

Three compute-bound ``nn.Sequential`` models that no calibration, cost model or test of this project
was fitted to (defined below: a residual MLP of 8 pre-LayerNorm blocks of width 1024, a plain
convolutional net on 16x16 images and a stack of pre-norm Transformer encoder blocks) go through the
public path, :func:`gpipe_repro.sim.own_model.simulate_model` (= ``gpipe-repro throughput --model
module:factory --in-situ``): per-layer costs calibrated on this host with the pipeline's other core
busy, the partition, the schedule simulated in virtual time, the same simulation corrected from a
short M = 1 run of the cut on the stage processes (:mod:`gpipe_repro.sim.in_situ`), then the
configuration run on K=2 real stage processes, apart from the correction's run. Mini-batch 256,
M = 1, 2, 4, 8, 16 (micro-batches of 256 down to 16 rows), checkpoint "never" and "always": 30
configurations, each with its uncorrected and its corrected error. With ``--rounds`` R > 1 the same
steps run in R interleaved rounds (:func:`run_in_rounds`): each model calibrated afresh in every
round right before its configurations, every configuration measured once a round, each round's steps
against the simulation from that round's costs, so that a calibration taken minutes before the
measurements no longer biases them (``--budget``: a third round only where it fits).
Targets: median |error| <= 5%, worst <= 10% where micro-batches have >= 16 rows (all of
these). Each configuration's error carries the interval its measured steps give it, and the verdict
is met / not met / inconclusive from those intervals
(:mod:`gpipe_repro.repro.throughput.simulator_error`): a busy host widens them, no row is left out.

Results: results/throughput/validation_unseen.{md,json} (the figures and the page:
:mod:`gpipe_repro.repro.validate_unseen_page`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from gpipe_repro.models.workload import Workload
from gpipe_repro.report.host import usable_cores
from gpipe_repro.report.measurement import another_round, item_fits
from gpipe_repro.report.output_guard import OutputRefused, check_manifest_outputs
from gpipe_repro.report.records import (
    measured,
    results_dir,
    simulated,
    write_json,
    write_markdown,
)
from gpipe_repro.repro.validate_unseen_page import (
    corrected_step,
    render,
    row_error,
    summarize,
    uncorrected_step,
)
from gpipe_repro.sim.calibration import Calibration, calibrate
from gpipe_repro.sim.jitter import measure_jitter
from gpipe_repro.sim.own_model import (
    attach_measurement,
    calibration_neighbours,
    in_situ_run,
    measure_steps,
    predict,
    worst_host,
)
from gpipe_repro.sim.partition_choice import choose_partition


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


class MeanPool(nn.Module):
    """The mean over a sequence's positions: (batch, tokens, width) -> (batch, width)."""

    def forward(self, x: Any) -> Any:
        return x.mean(dim=1)


def transformer_blocks(width: int = 128, blocks: int = 6, heads: int = 4,
                       classes: int = 10) -> nn.Sequential:
    """An unseen model: pre-norm Transformer encoder blocks (feed-forward 4 x width) on (batch, 32
    tokens, width) features, mean-pooled, then a classifier."""
    return nn.Sequential(*[nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                      batch_first=True, norm_first=True)
                           for _ in range(blocks)], MeanPool(), nn.Linear(width, classes))


#: The stage processes of every configuration.
K = 2

MODELS: dict[str, tuple[str, tuple[int, ...]]] = {
    "residual MLP 8x1024": ("gpipe_repro.repro.validate_unseen:residual_mlp", (1024,)),
    "conv net 6x32 on 16x16": ("gpipe_repro.repro.validate_unseen:conv_net", (3, 16, 16)),
    "transformer 6x128 on 32 tokens": ("gpipe_repro.repro.validate_unseen:transformer_blocks", (32, 128)),
}


def run_config(workload: Workload, *, k: int, m: int, microbatch: int, checkpoint: str,
               steps: int, in_situ: bool = True, in_situ_m: int = 1) -> dict[str, Any]:
    """One configuration the public way (calibrate, simulate, correct from an in-situ run of
    `in_situ_m` micro-batches per step where `in_situ`, then run on `k` stage processes)."""
    from gpipe_repro.sim.own_model import simulate_model
    result = simulate_model(workload, k=k, m=m, microbatch=microbatch, checkpoint=checkpoint,
                            validate=True, steps=steps, in_situ=in_situ, in_situ_microbatches=in_situ_m)
    return result.to_json()


@dataclass
class Seams:
    """What a validation in rounds calls to calibrate, correct in situ and measure (the public
    path's pieces, :mod:`gpipe_repro.sim.own_model`; a test gives its own)."""

    calibrate: Callable[[Workload, list[int], int], Calibration]
    in_situ: Callable[..., list[Any]]
    measure: Callable[..., tuple[list[float], dict[str, Any]]]
    variation: Callable[[], object] = lambda: None   # the host's action-duration variation, now


def _calibrate_afresh(workload: Workload, sizes: list[int], repeats: int) -> Calibration:
    """Per-layer costs timed now, as the public path times them (one thread, the pipeline's other
    core busy), never read from the cache: every round samples the host as it is then."""
    return calibrate(workload, sizes, method="time", device="cpu", threads=1, repeats=repeats,
                     use_cache=False, neighbours=calibration_neighbours(K, "cpu"))


def _variation_now() -> object:
    """This host's variation of action durations measured now, not read from the cache (the
    simulations then draw from it: :mod:`gpipe_repro.sim.jitter`): it changes with the host's
    phases, as the costs do."""
    return measure_jitter(refresh=True)


PUBLIC_SEAMS = Seams(_calibrate_afresh, in_situ_run, measure_steps, _variation_now)


def run_in_rounds(configs: Sequence[tuple[str, str, int]], *, batch: int, steps: int, rounds: int,
                  repeats: int, in_situ: bool, in_situ_m: int, seams: Seams = PUBLIC_SEAMS,
                  say: Callable[[str], None] = print, budget_s: float | None = None,
                  clock: Callable[[], float] | None = None) -> list[dict[str, Any]]:
    """Every configuration (model, checkpoint, M) measured `steps` steps once per round, `rounds`
    rounds in alternating order, each model calibrated afresh in every round right before its first
    configuration of the round; its error pairs each round's measured steps with the simulation
    from that round's calibration (``*_per_round_s``), its simulated step (and the unpaired error)
    from the median of its model's calibrations (:meth:`Calibration.median_of`), its cut from the
    first, its in-situ correction (where `in_situ`) from a run of its own before its first
    measurement. With `budget_s`, a round after the second starts only where one more round of
    the mean length so far fits in it (:func:`another_round`), and a round after the first ends
    at the first configuration that would not end within it (:func:`item_fits`); each row says the
    rounds it ran.
    The public path's steps (calibrate, partition, correct in situ, simulate, measure), with the
    calibrations and the measured steps spread over the same stretch of the host's states
    instead of one calibration before them all and one burst per configuration."""
    names = list(dict.fromkeys(name for name, _, _ in configs))
    workloads = {name: _workload(name) for name in names}
    sizes = {name: sorted({batch // m for n, _, m in configs if n == name}) for name in names}
    calibrations: dict[str, list[Calibration]] = {name: [] for name in names}
    balances: dict[int, list[int]] = {}
    situ_runs: dict[int, list[Any]] = {}
    steps_of: dict[int, list[list[float]]] = {i: [] for i in range(len(configs))}   # per round
    hosts: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(configs))}
    clock = clock or time.monotonic
    started = clock()
    say("measuring how action durations vary in a pipeline on this host now")
    seams.variation()
    took: dict[int, float] = {}               # each configuration's last run, seconds
    calibrating: dict[str, float] = {}        # each model's last calibration, seconds
    r, cut_short = 0, False
    while not cut_short and another_round(r, rounds, clock() - started, budget_s):
        order = range(len(configs)) if r % 2 == 0 else range(len(configs) - 1, -1, -1)
        fresh: set[str] = set()
        for i in order:
            name, checkpoint, m = configs[i]
            microbatch = batch // m
            expected = took.get(i, 0.0) + (calibrating.get(name, 0.0) if name not in fresh else 0.0)
            if r > 0 and not item_fits(clock() - started, expected, budget_s):
                say(f"round {r + 1} ends after {sum(len(x) > r for x in steps_of.values())} of "
                    f"{len(configs)} configurations: the next would not end within the "
                    f"{budget_s:g} s budget")
                cut_short = True
                break
            if name not in fresh:
                say(f"calibrating {name} at {sizes[name]} rows (round {r + 1} of {rounds})")
                began = clock()
                calibrations[name].append(seams.calibrate(workloads[name], sizes[name], repeats))
                calibrating[name] = clock() - began
                fresh.add(name)
            if i not in balances:
                first = calibrations[name][0]
                balances[i] = choose_partition(first.partition_costs(microbatch, checkpoint), K,
                                               "bottleneck", first.uncertainty_at(microbatch))
                if in_situ:
                    situ_runs[i] = seams.in_situ(workloads[name], balances[i], microbatch=microbatch,
                                                 checkpoint=checkpoint, schedule="gpipe", threads=1,
                                                 steps=3, micro_batches=in_situ_m)
            say(f"{name}: K={K} M={m} checkpoint={checkpoint} (round {r + 1} of {rounds})")
            began = clock()
            got, host = seams.measure(workloads[name], balances[i], m=m, microbatch=microbatch,
                                      checkpoint=checkpoint, steps=steps)
            took[i] = clock() - began
            steps_of[i].append(list(got))
            hosts[i].append(host)
        r += 1
    pooled = {name: Calibration.median_of(cs) for name, cs in calibrations.items()}
    rows = []
    for i, (name, checkpoint, m) in enumerate(configs):
        result = predict(workloads[name], pooled[name], balances[i], m=m, microbatch=batch // m,
                         checkpoint=checkpoint, in_situ_timelines=situ_runs.get(i),
                         in_situ_microbatches=in_situ_m, jitter=True)
        attach_measurement(result, [t for got in steps_of[i] for t in got], worst_host(hosts[i]))
        row = result.to_json()
        row["model"], row["rounds"] = name, len(steps_of[i])
        row["measured_step_times_per_round_s"] = steps_of[i]
        row["uncorrected_step_per_round_s"] = [
            predict(workloads[name], cal, balances[i], m=m, microbatch=batch // m,
                    checkpoint=checkpoint, jitter=True).step_time_s for cal in calibrations[name]]
        rows.append(row)
    return rows


def _cut_round(rows: Sequence[dict[str, Any]]) -> int | None:
    """How many configurations a round cut short by the budget measured (those with a run more
    than the others); None where every configuration ran the same rounds."""
    counts = [r.get("rounds", 1) for r in rows]
    return sum(c > min(counts) for c in counts) if counts and max(counts) > min(counts) else None


def _print_row(row: dict[str, Any]) -> None:
    """One configuration's figures, as a line of progress."""
    line = (f"{row['model']} M={row['M']} {row['checkpoint']}: simulated "
            f"{uncorrected_step(row) * 1e3:.1f} ms, measured "
            f"{row['measured_step_time_s'] * 1e3:.1f} ms; error {row_error(row).cell()}")
    if corrected_step(row) is not None:
        line += (f"; in-situ corrected {row['step_time_s'] * 1e3:.1f} ms, error "
                 f"{row_error(row, corrected=True).cell()}")
    print(line, flush=True)


def _workload(name: str) -> Workload:
    factory, shape = MODELS[name]
    return Workload.create(name, factory, "features", shape, 10)


def main(*, batch: int = 256, ms: Sequence[int] = (1, 2, 4, 8, 16),
         checkpoints: Sequence[str] = ("never", "always"), models: Sequence[str] = tuple(MODELS),
         steps: int = 8, rounds: int = 1, repeats: int = 20, out: str | None = None,
         command: str = "make validate-unseen", in_situ: bool = True, in_situ_m: int = 1,
         budget: float | None = None, overwrite: bool = False, record: bool = False,
         run: Callable[..., dict[str, Any]] = run_config, seams: Seams = PUBLIC_SEAMS) -> dict[str, Any]:
    """Run every configuration, write the results (`command`: how the page says it was made;
    `in_situ`: also correct each from a short run of its own and report both errors).

    `rounds` = 1: each configuration as ``gpipe-repro throughput --model ... --validate --rounds 1``
    runs it (`run`: its calibration from the cache where one was timed before, `steps` steps in one
    burst). `rounds` > 1: :func:`run_in_rounds` (each model calibrated afresh in every round at
    `repeats` timings a layer, `steps` steps per configuration and round)."""
    if usable_cores() < K:
        raise SystemExit(f"validation runs K={K} stage processes on one core each; this host has "
                         f"{usable_cores()} usable core(s)")
    if rounds < 1 or repeats < 1:
        raise SystemExit(f"--rounds {rounds}, --repeats {repeats}: both must be >= 1")
    if budget is not None and not budget > 0:
        raise SystemExit(f"--budget {budget}: give the seconds the rounds end within, > 0")
    bad = [m for m in ms if m < 1 or batch % m]
    if bad:
        raise SystemExit(f"--ms {bad}: every M must divide --batch-size {batch}")
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        raise SystemExit(f"--models {unknown}: the models are {', '.join(map(repr, MODELS))}")
    folder = results_dir("throughput") if out is None else Path(out)
    check_out_dir(folder, overwrite=overwrite, record=record)
    configs = [(name, checkpoint, m) for name in models for checkpoint in checkpoints for m in ms]
    if rounds > 1:
        rows = run_in_rounds(configs, batch=batch, steps=steps, rounds=rounds, repeats=repeats,
                             in_situ=in_situ, in_situ_m=in_situ_m, seams=seams, budget_s=budget,
                             say=lambda line: print(line, flush=True))
        for row in rows:
            _print_row(row)
    else:
        rows = []
        for name, checkpoint, m in configs:
            print(f"{name}: K={K} M={m} checkpoint={checkpoint}", flush=True)
            row = run(_workload(name), k=K, m=m, microbatch=batch // m, checkpoint=checkpoint,
                      steps=steps, in_situ=in_situ, **({"in_situ_m": in_situ_m} if in_situ else {}))
            row["model"] = name
            _print_row(row)
            rows.append(row)
    config = {"batch": batch, "ms": list(ms), "checkpoints": list(checkpoints), "models": list(models),
              "steps": steps, "rounds": min((r.get("rounds", 1) for r in rows), default=rounds),
              "last_round_configurations": _cut_round(rows),
              "rounds_asked": rounds, "budget_s": budget, "repeats": repeats, "out": out,
              "in_situ": in_situ,
              "in_situ_m": in_situ_m}
    payload = {"experiment": "simulator vs real runs on models it was never tuned on",
               "method": "measured_*: steps measured on this host's 2 real stage processes; "
                         "step_time_s and the uncorrected figures: simulated from per-layer costs "
                         "calibrated on this host, action durations drawn as they vary in a "
                         "pipeline here; summary: in rounds, each round's measured steps against "
                         "the simulation from that round's calibration (*_per_round_s), "
                         "summary_unpaired: all against the median calibration; in_situ: "
                         "simulated from costs corrected by a separate short run on the stage "
                         "processes",
               "command": command, "config": config, "usable_cores": usable_cores(), "rows": rows,
               "summary": summarize(rows)}
    if rounds > 1:
        payload["summary_unpaired"] = summarize(rows, paired=False)
    if in_situ:
        payload["summary_in_situ"] = summarize(rows, corrected=True)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / MANIFEST, {
        **payload, "written_by": COMMAND, "step_time_s": {f"{r['model']}/{r['checkpoint']}/M{r['M']}": {
            "measured": measured(r["measured_step_time_s"], unit="s"),
            "simulated": simulated(uncorrected_step(r), unit="s"),
            **({"simulated_in_situ": simulated(r["step_time_s"], unit="s")} if r.get("in_situ") else {})}
            for r in rows}})
    text = render(payload)
    write_markdown(folder / "validation_unseen.md", text)
    print(text)
    return payload


COMMAND = "validate-unseen"
MANIFEST = "validation_unseen.json"


def check_out_dir(folder: Path, *, overwrite: bool, record: bool) -> None:
    """Refuse, before any work, to replace a file in `folder` this command did not write (its
    validation_unseen.json says whether the pair is its own), or its own without --overwrite, or the
    results of record without --record (what `make validate-unseen` gives):
    :func:`gpipe_repro.report.output_guard.check_outputs`."""
    if folder.exists() and not folder.is_dir():
        raise SystemExit(f"--out {folder} is a file, not a directory: give a directory")

    try:
        check_manifest_outputs(folder / MANIFEST, [folder / "validation_unseen.md"], command=COMMAND,
                               option="--out", overwrite=overwrite, record=record,
                               legacy=lambda d: isinstance(d, dict) and "rows" in d and "experiment" in d)
    except OutputRefused as e:
        raise SystemExit(str(e)) from None
