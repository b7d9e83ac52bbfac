"""`gpipe-repro throughput --model module:factory`: simulate your own model as a GPipe pipeline.

    gpipe-repro throughput --model mypackage.models:make_mlp --input-shape 784 --classes 10 \\
        --k 4 --m 8 --microbatch 32 --checkpoint except_last --option width=1024

The factory returns an ``nn.Sequential`` (or a list of layers); ``--option key=value`` (repeatable)
are its keyword arguments. Prints the partition, the simulated step time and the speedup over one
device, and, where K fits the host, the same configuration measured on K stage processes (with
``--in-situ``, the simulation corrected from a short run of its own beside the uncorrected one, each
with its error); then which
cut was simulated (the simulator's, balanced by the calibrated times) beside the cut ``GPipe`` makes
by default on the same model, with a sample and without one, each simulated with the same
calibration. The library
function is :func:`gpipe_repro.sim.own_model.simulate_model`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from gpipe_repro.engine.arguments import as_layers
from gpipe_repro.engine.batchnorm import is_one_value_per_channel
from gpipe_repro.models.workload import Workload
from gpipe_repro.sim.own_model import simulate_model

COMMAND = "throughput"


def _one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _returned_type(workload: Workload, any_container: bool = False) -> str | None:
    """The type name of what the user's factory returns when that is not iterable (`any_container`:
    when it is not a sequence of layers either: a dict, a set), else None."""
    from gpipe_repro.models.workload import _factory
    if ":" not in workload.family:
        return None
    try:
        made = _factory(workload.family)(**dict(workload.options))
    except Exception:  # noqa: BLE001 - reported by the caller as the build's own error
        return None
    if any_container and not isinstance(made, (list, tuple, nn.Sequential, nn.ModuleList)):
        return type(made).__name__
    try:
        iter(made)
    except TypeError:
        return type(made).__name__
    return None


def preflight(workload: Workload, batch: int, *, options: dict[str, Any]) -> str | None:
    """Build the model once and run one forward pass of a `batch`-example sample, layer by layer,
    without gradients; None when both work, else the one-line reason (what to change). Catches a
    factory that fails or returns something other than layers, and an --input-shape the model cannot
    take, before the calibration's work starts."""
    import torch

    try:
        layers = workload.build("cpu")
    except Exception as e:  # noqa: BLE001 - the user's factory: any failure is theirs to fix
        returned = _returned_type(workload) if isinstance(e, TypeError) else None
        if returned is not None:
            return (f"--model {workload.family} must return an nn.Sequential or a list of nn.Module "
                    f"layers; it returned {returned}")
        hint = (" (--option values are Python literals: numbers as 64, strings quoted; given: "
                + ", ".join(f"{k}={v!r}" for k, v in options.items()) + ")") if options else ""
        return f"--model {workload.family}: building the model raised {_one_line(e)}{hint}"
    not_layers = [type(x).__name__ for x in layers if not isinstance(x, nn.Module)]
    if not layers or not_layers:
        made = _returned_type(workload, any_container=True)
        what = ("nothing" if not layers else f"a {made}" if made is not None
                else "a sequence holding " + ", ".join(sorted(set(not_layers))))
        return (f"--model {workload.family} must return an nn.Sequential or a list of nn.Module "
                f"layers; it returned {what}")
    try:
        as_layers(layers)     # the engine's own rule for what a model of layers is, its words
    except (TypeError, ValueError) as e:
        return f"--model {workload.family}: {e}"
    x, target = workload.sample(batch, "cpu")
    shape = "(" + ", ".join(map(str, workload.input_shape)) + ")"
    with torch.no_grad():
        for i, layer in enumerate(layers):
            try:
                x = layer(x)
            except Exception as e:  # noqa: BLE001 - any failure here means the input does not fit
                where = "its first layer" if i == 0 else f"its layer {i} ({type(layer).__name__})"
                said = _one_line(e)
                if is_one_value_per_channel(e):
                    return (f"--microbatch {batch}: {where} (a BatchNorm) cannot train on one value "
                            f"per channel ({said}); give --microbatch 2 or more")
                if "must have the same dtype" in said:         # ids into a float layer, or back
                    given = "integer token ids" if workload.kind == "tokens" else "floats"
                    return (f"--kind {workload.kind} gives the model {given}, and {where} raised "
                            f"{said}: give the --kind of inputs the model takes (features, image, "
                            "tokens)")
                return f"--input-shape {shape} does not fit the model: {where} raised: {said}"
        try:
            workload.loss_fn()(x, target)
        except Exception as e:  # noqa: BLE001 - the output does not fit the targets
            width = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            return (f"the model's output {width} does not fit its targets ({workload.kind}, "
                    f"--classes {workload.classes}): the loss raised {_one_line(e)}; make --classes "
                    "match the model's last layer")
    return None


_BY = {"time": "measured time", "params": "parameters", "flops": "FLOPs", "activations": "activations"}


def engine_default_cuts(workload: Workload, k: int, sample: Any) -> dict[str, Any]:
    """The cut ``GPipe(layers, partitions=k)`` makes with its default cost and objective, given
    `sample` and given none: ``{"with_sample": cut, "with_sample_by": cost, "without_sample": ...,
    "without_sample_by": ...}``. Computed by the engine's own functions on the real layers (a
    measured cost is measured again here, as GPipe measures it at construction)."""
    import inspect

    from gpipe_repro.engine.gpipe import GPipe
    from gpipe_repro.engine.layer_costs import layer_costs
    from gpipe_repro.engine.partition import partition
    defaults = inspect.signature(GPipe.__init__).parameters
    cost, objective = defaults["cost"].default, defaults["objective"].default
    layers = workload.build("cpu")
    out: dict[str, Any] = {}
    for name, given in (("with_sample", sample), ("without_sample", None)):
        by = cost if cost is not None else ("time" if given is not None else "params")
        out[name] = partition(layer_costs(layers, by, given), k, objective)
        out[f"{name}_by"] = by
    return out


def compare_cuts(workload: Workload, result: Any, kw: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """One line saying which cut was simulated and how GPipe's default cut on the same model
    compares (each simulated with the same calibration), and the same as data."""
    from gpipe_repro.report.host import usable_cores
    from gpipe_repro.sim.calibration import calibrate
    from gpipe_repro.sim.platform import platform_for
    from gpipe_repro.sim.simulator import simulate_config

    k, m, microbatch = kw["k"], kw["m"], kw["microbatch"]
    how = {"time": "measured time", "flops": "FLOP-estimated time"}[kw["method"]]
    how += "" if kw["objective"] == "bottleneck" else f", objective {kw['objective']}"
    if k == 1:
        return f"cut: {result.balance} (K=1: one cell, nothing to balance)", {"simulated": result.balance}
    n = m * microbatch
    # the calibration simulate_model made (cached): the same arguments
    neighbours = max(0, min(usable_cores(), k) - 1) if kw["method"] == "time" else 0
    calib = calibrate(workload, sorted({microbatch, n}), method=kw["method"], device="cpu", threads=1,
                      repeats=kw["repeats"], neighbours=neighbours)
    platform = platform_for(kw["link"])

    def step_time(cut: list[int]) -> float:
        return simulate_config(calib, cut, m, n, platform.link, checkpoint=kw["checkpoint"],
                               recompute_ahead=kw["recompute_ahead"], setup=platform.setup,
                               teardown=platform.teardown).step_time

    defaults = engine_default_cuts(workload, k, workload.sample(microbatch)[0])
    base = step_time(result.balance)
    data: dict[str, Any] = {"simulated": result.balance, "simulated_by": how, **defaults}

    def versus(name: str) -> str:
        cut, by = defaults[name], _BY.get(defaults[f"{name}_by"], defaults[f"{name}_by"])
        if cut == result.balance:
            return f"{cut} (by {by}: the same cut)"
        ratio = step_time(cut) / base
        data[f"{name}_step_ratio"] = ratio
        speed = f"{ratio:.2f}x slower" if ratio >= 1 else f"{1 / ratio:.2f}x faster"
        return f"{cut} (by {by}: simulated {speed})"

    line = (f"cut: simulating {result.balance} (balanced by {how}); GPipe's default for this model "
            f"with sample= a micro-batch of {microbatch} is {versus('with_sample')}; without a sample "
            f"{versus('without_sample')}")
    return line, data


def main(workload: Workload, *, out: Path | None = None, **kw: Any) -> None:
    """Simulate (and, where K fits, measure) and print, with the cut compared to GPipe's default;
    `kw` are :func:`gpipe_repro.sim.own_model.simulate_model`'s; `out`: also write the JSON there.

    Raises:
        ValueError: the model and the options do not go together (the message says what to change).
    """
    import sys

    from gpipe_repro.report.measurement import Progress
    with Progress(COMMAND, stream=sys.stderr) as shown:   # a plain line every 30 s off a terminal
        result = simulate_model(workload, progress=shown.update, **kw)
    cut_line, cuts = compare_cuts(workload, result, kw)
    print(result.describe())
    print(f"  {cut_line}")
    if out is not None:
        from gpipe_repro.report.records import write_json
        errors = {name: figure.to_json() for name, figure in (
            ("uncorrected", result.error(corrected=False)),
            ("in_situ_corrected", result.error() if result.in_situ else None)) if figure is not None}
        write_json(out, {**result.to_json(), "errors": errors, "cuts": cuts, "written_by": COMMAND})
        print(f"wrote {out}")
