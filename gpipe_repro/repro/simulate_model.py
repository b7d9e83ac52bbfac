"""`gpipe-repro throughput --model module:factory`: simulate your own model as a GPipe pipeline.

    gpipe-repro throughput --model mypackage.models:make_mlp --input-shape 784 --classes 10 \\
        --k 4 --m 8 --microbatch 32 --checkpoint except_last --option width=1024

The factory returns an ``nn.Sequential`` (or a list of layers); ``--option key=value`` (repeatable)
are its keyword arguments. Prints the partition, the simulated step time and the speedup over one
device, and, where K fits the host, the same configuration measured on K stage processes. The library
function is :func:`gpipe_repro.sim.own_model.simulate_model`.
"""
from __future__ import annotations

import argparse
import ast
import sys
from typing import Any

from gpipe_repro.engine.partition import OBJECTIVES
from gpipe_repro.engine.schedule import CHECKPOINT_MODES
from gpipe_repro.models.workload import KINDS, Workload
from gpipe_repro.sim.links import LINK_NAMES
from gpipe_repro.sim.own_model import simulate_model


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


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
    args = ap.parse_args(argv)
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
    kw = dict(k=args.k, m=args.m, microbatch=args.microbatch, checkpoint=args.checkpoint,
              recompute_ahead=args.recompute_ahead, objective=args.objective, link=args.link,
              method=args.method, repeats=args.repeats, validate=args.validate)
    return workload, kw, args.json


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Simulate (and, where K fits, measure) and print."""
    workload, kw, json_path = parse(argv, prog)
    try:
        result = simulate_model(workload, **kw)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(result.describe())
    if json_path:
        from gpipe_repro.report.records import write_json
        write_json(json_path, result.to_json())
        print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
