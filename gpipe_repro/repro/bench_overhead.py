"""`make bench-overhead`: what the engine costs when there is nothing to pipeline.

Side by side in one run, interleaved step by step so machine noise hits both alike: a plain PyTorch
training step (zero_grad, forward, loss, backward, optimizer step) against `GPipe` with K=1, M=1 on
the same model, batch and thread count. Target: ratio <= 1.03 with checkpoint="never". The same with
re-materialization on (checkpoint="always") shows the recompute cost (the paper's: about 25-33%).

Two more pairs price the engine's guarantees, each against its own baseline in the same run:

- in-place layers: GPipe K=2 M=4 cut right before a ``ReLU(inplace=True)`` (that cell's input is
  copied for every forward and recompute) against the same cut with ``ReLU()`` (no copy; only the
  version-counter check, which every cell pays);
- global clipping: GPipe K=1 M=1 with ``clip_grad_norm`` (the global norm computed at AGREE) against
  a plain step with ``torch.nn.utils.clip_grad_norm_``.

Medians of many steps after warm-up; results in results/overhead/ (measured), with the host's load
average before and after.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.report.host import HostWatch, busy_note, is_clean
from gpipe_repro.report.records import markdown_table, measured, results_dir, write_json, write_markdown


def model(width: int, depth: int, inplace: bool = False) -> list[nn.Module]:
    """`depth` x (Linear, ReLU) then a Linear to 10 classes."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU(inplace=inplace)]
    return layers + [nn.Linear(width, 10)]



def _train_step_of(pipe: GPipe, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    return lambda: pipe.train_step(x, y)

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()
    opt_factory = lambda ps: torch.optim.SGD(ps, lr=1e-3)  # noqa: E731

    plain = nn.Sequential(*model(args.width, args.depth))
    plain_opt = opt_factory(plain.parameters())

    def plain_step() -> None:
        plain_opt.zero_grad(set_to_none=True)
        loss_fn(plain(x), y).backward()
        plain_opt.step()

    def plain_clip_step() -> None:
        plain_opt.zero_grad(set_to_none=True)
        loss_fn(plain(x), y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()

    variants = {mode: GPipe(copy.deepcopy(list(plain)), partitions=1, micro_batches=1, checkpoint=mode,
                            loss_fn=loss_fn, optimizer=opt_factory) for mode in ("never", "always")}
    cut = 1   # right before the first ReLU: the in-place one is the first layer of cell 1
    n_layers = 2 * args.depth + 1
    for name, inplace in (("cut before ReLU", False), ("cut before ReLU(inplace)", True)):
        variants[name] = GPipe(model(args.width, args.depth, inplace), partitions=2, micro_batches=4,
                               balance=[cut, n_layers - cut], checkpoint="except_last", loss_fn=loss_fn,
                               optimizer=opt_factory)
    variants["clip"] = GPipe(copy.deepcopy(list(plain)), partitions=1, micro_batches=1, checkpoint="never",
                             loss_fn=loss_fn, optimizer=opt_factory, clip_grad_norm=1.0)
    times: dict[str, list[float]] = {"plain": [], "plain clip": [], **{m: [] for m in variants}}
    steps: dict[str, Callable[[], Any]] = {"plain": plain_step, "plain clip": plain_clip_step,
             **{m: _train_step_of(p, x, y) for m, p in variants.items()}}
    load_before = os.getloadavg()
    names = list(steps)
    with HostWatch() as watch:      # idle before, other processes' CPU during
        for i in range(args.warmup + args.steps):
            # Rotate the order every step so no variant always runs first (warm caches, allocator).
            for name in names[i % len(names):] + names[:i % len(names)]:
                fn = steps[name]
                t0 = time.perf_counter()
                fn()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
    load_after = os.getloadavg()
    clean = busy_note(watch.conditions) or " clean host"
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio_never, ratio_always = med["never"] / med["plain"], med["always"] / med["plain"]
    ratio_inplace = med["cut before ReLU(inplace)"] / med["cut before ReLU"]
    ratio_clip = med["clip"] / med["plain clip"]
    rows = [["plain PyTorch step", med["plain"] * 1e3, 1.0, "-"],
            ["GPipe K=1 M=1 checkpoint=never", med["never"] * 1e3, ratio_never, "<= 1.03"],
            ["GPipe K=1 M=1 checkpoint=always", med["always"] * 1e3, ratio_always,
             "recompute: paper ~1.25-1.33"],
            ["GPipe K=2 M=4, cut before ReLU", med["cut before ReLU"] * 1e3, 1.0, "baseline of the next"],
            ["GPipe K=2 M=4, cut before ReLU(inplace): input copied", med["cut before ReLU(inplace)"] * 1e3,
             ratio_inplace, "copy of one boundary per forward/recompute"],
            ["plain step + clip_grad_norm_", med["plain clip"] * 1e3, 1.0, "baseline of the next"],
            ["GPipe K=1 M=1 clip_grad_norm=1 (norm at AGREE)", med["clip"] * 1e3, ratio_clip, "<= 1.03"]]
    table = markdown_table(["step", "median ms (measured)", "ratio to its baseline", "target"], rows)
    print(table)
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after};{clean}")
    out = results_dir("overhead")
    config = vars(args)
    write_json(out / "overhead.json", {
        "experiment": "engine overhead vs plain PyTorch", "config": config,
        "median_step_s": {k: measured(v, unit="s") for k, v in med.items()},
        "ratio_never": measured(ratio_never), "ratio_always": measured(ratio_always),
        "ratio_inplace_copy": measured(ratio_inplace), "ratio_clip": measured(ratio_clip),
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "host": watch.conditions, "host_clean": is_clean(watch.conditions),
        "steps": {k: v for k, v in times.items()}})
    write_markdown(out / "overhead.md", "# Engine overhead (measured)\n\n"
                   f"MLP {args.depth}x{args.width}, batch {args.batch}, {args.threads} thread(s), "
                   f"median of {args.steps} interleaved steps after {args.warmup} warm-up; load average "
                   f"before {load_before}, after {load_after};{clean}.\n\n" + table)


if __name__ == "__main__":
    main()
