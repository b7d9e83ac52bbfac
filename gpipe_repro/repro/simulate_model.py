"""`gpipe-repro throughput --model module:factory`: simulate your own model as a GPipe pipeline.

    gpipe-repro throughput --model mypackage.models:make_mlp --input-shape 784 --classes 10 \\
        --k 4 --m 8 --microbatch 32 --checkpoint except_last --option width=1024

The factory returns an ``nn.Sequential`` (or a list of layers); ``--option key=value`` (repeatable)
are its keyword arguments. Prints the partition, the simulated step time and the speedup over one
device, and, where K fits the host, the same configuration measured on K stage processes; then which
cut was simulated (the simulator's, balanced by the calibrated times) beside the cut ``GPipe`` makes
by default on the same model, with a sample and without one, each simulated with the same
calibration. The library
function is :func:`gpipe_repro.sim.own_model.simulate_model`.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Any

from gpipe_repro.engine.partition import OBJECTIVES
from gpipe_repro.engine.schedule import CHECKPOINT_MODES
from gpipe_repro.models.workload import KINDS, Workload
from gpipe_repro.sim.links import LINK_NAMES
from gpipe_repro.sim.own_model import simulate_model

COMMAND = "throughput"


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _returned_type(workload: Workload) -> str | None:
    """The type name of what the user's factory returns when that is not iterable, else None."""
    from gpipe_repro.models.workload import _factory
    if ":" not in workload.family:
        return None
    try:
        made = _factory(workload.family)(**dict(workload.options))
    except Exception:  # noqa: BLE001 - reported by the caller as the build's own error
        return None
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
    from torch import nn

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
        return (f"--model {workload.family} must return an nn.Sequential or a list of nn.Module "
                f"layers; it returned {'nothing' if not layers else ', '.join(sorted(set(not_layers)))}")
    seen: dict[int, int] = {}
    for i, layer in enumerate(layers):
        if id(layer) in seen:
            return (f"--model {workload.family}: layers {seen[id(layer)]} and {i} are the same module "
                    "object; a pipeline runs each layer once per micro-batch, so give each position "
                    "its own module (copy.deepcopy it), or share weights inside one layer")
        seen[id(layer)] = i
    x, target = workload.sample(batch, "cpu")
    shape = "(" + ", ".join(map(str, workload.input_shape)) + ")"
    with torch.no_grad():
        for i, layer in enumerate(layers):
            try:
                x = layer(x)
            except Exception as e:  # noqa: BLE001 - any failure here means the shape does not fit
                where = "its first layer" if i == 0 else f"its layer {i} ({type(layer).__name__})"
                return f"--input-shape {shape} does not fit the model: {where} raised: {_one_line(e)}"
        try:
            workload.loss_fn()(x, target)
        except Exception as e:  # noqa: BLE001 - the output does not fit the targets
            width = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            return (f"the model's output {width} does not fit its targets ({workload.kind}, "
                    f"--classes {workload.classes}): the loss raised {_one_line(e)}; make --classes "
                    "match the model's last layer")
    return None


def parse(argv: list[str] | None = None,
          prog: str | None = None) -> tuple[Workload, dict[str, Any], str | None]:
    """(workload, simulate_model keywords, --json path) from the command line; errors name the fix."""
    ap = argparse.ArgumentParser(prog=prog or "gpipe-repro throughput", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="module:function returning the layers")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a keyword argument of the factory (repeatable)")
    ap.add_argument("--kind", choices=KINDS, default="features",
                    help="features: float inputs, class targets (default); image; tokens")
    ap.add_argument("--input-shape", type=int, nargs="+", required=True,
                    help="one example's shape, e.g. 784 or 3 32 32 (tokens: sequence length)")
    ap.add_argument("--classes", type=int, default=10, help="classes (or vocabulary size for tokens)")
    ap.add_argument("--k", type=int, required=True, help="pipeline stages (cells)")
    ap.add_argument("--m", type=int, required=True, help="micro-batches per mini-batch")
    ap.add_argument("--microbatch", type=int, default=8, help="examples per micro-batch")
    ap.add_argument("--checkpoint", choices=CHECKPOINT_MODES, default="except_last")
    ap.add_argument("--recompute-ahead", action="store_true")
    ap.add_argument("--objective", choices=OBJECTIVES, default="bottleneck")
    ap.add_argument("--link", choices=LINK_NAMES, default="gloo-loopback")
    ap.add_argument("--method", choices=("time", "flops"), default="time")
    ap.add_argument("--repeats", type=int, default=20, help="timings per layer action")
    ap.add_argument("--validate", dest="validate", action="store_true", default=None,
                    help="also run on K stage processes (default: where K fits the host)")
    ap.add_argument("--no-validate", dest="validate", action="store_false")
    ap.add_argument("--json", default=None, help="also write the result to this JSON file")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier result of this command at --json")
    args = ap.parse_args(argv)
    bad = [n for n in args.input_shape if n < 1]
    if bad:
        ap.error(f"--input-shape takes sizes >= 1 (one example's shape, e.g. 784 or 3 32 32), got "
                 f"{' '.join(map(str, args.input_shape))}")
    for flag in ("k", "m", "microbatch", "repeats", "classes"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--option takes KEY=VALUE, got {item!r}")
        options[key] = _value(value)
    try:
        workload = Workload.create(args.model, args.model, args.kind, args.input_shape, args.classes,
                                   **options)
    except ValueError as e:
        ap.error(str(e))
    if args.json is not None:
        from gpipe_repro.report.records import OutputRefused, check_outputs
        try:
            check_outputs([Path(args.json)], command=COMMAND, option="--json", overwrite=args.overwrite)
        except OutputRefused as e:
            ap.error(str(e))
    problem = preflight(workload, args.microbatch, options=options)
    if problem is not None:
        ap.error(problem)
    kw = dict(k=args.k, m=args.m, microbatch=args.microbatch, checkpoint=args.checkpoint,
              recompute_ahead=args.recompute_ahead, objective=args.objective, link=args.link,
              method=args.method, repeats=args.repeats, validate=args.validate)
    return workload, kw, args.json


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


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Simulate (and, where K fits, measure) and print, with the cut compared to GPipe's default."""
    workload, kw, json_path = parse(argv, prog)
    try:
        result = simulate_model(workload, **kw)
        cut_line, cuts = compare_cuts(workload, result, kw)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(result.describe())
    print(f"  {cut_line}")
    if json_path:
        from gpipe_repro.report.records import write_json
        write_json(json_path, {**result.to_json(), "cuts": cuts, "written_by": COMMAND})
        print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
