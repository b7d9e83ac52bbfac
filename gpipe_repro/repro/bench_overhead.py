"""`make bench-overhead`: what the engine costs when there is nothing to pipeline.

Side by side in one run, interleaved step by step so machine noise hits both alike: a plain PyTorch
training step (zero_grad, forward, loss, backward, optimizer step) against `GPipe` with K=1, M=1 on
the same model, batch and thread count. Target: ratio <= 1.03 with checkpoint="never". The same with
re-materialization on (checkpoint="always") shows the recompute cost (the paper's: about 25-33%).
Medians of many steps after warm-up; results in results/overhead/ (measured).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from gpipe_repro import GPipe
from gpipe_repro.report.records import markdown_table, measured, results_dir, write_json, write_markdown


def model(width: int, depth: int) -> list[nn.Module]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return layers + [nn.Linear(width, 10)]


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

    variants = {mode: GPipe(copy.deepcopy(list(plain)), partitions=1, micro_batches=1, checkpoint=mode,
                            loss_fn=loss_fn, optimizer=opt_factory) for mode in ("never", "always")}
    times: dict[str, list[float]] = {"plain": [], **{m: [] for m in variants}}
    steps = {"plain": plain_step, **{m: (lambda p=p: p.train_step(x, y)) for m, p in variants.items()}}
    names = list(steps)
    for i in range(args.warmup + args.steps):
        # Rotate the order every step so no variant always runs first (warm caches, allocator state).
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn = steps[name]
            t0 = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio_never, ratio_always = med["never"] / med["plain"], med["always"] / med["plain"]
    rows = [["plain PyTorch step", med["plain"] * 1e3, 1.0, "-"],
            ["GPipe K=1 M=1 checkpoint=never", med["never"] * 1e3, ratio_never, "<= 1.03"],
            ["GPipe K=1 M=1 checkpoint=always", med["always"] * 1e3, ratio_always,
             "recompute: paper ~1.25-1.33"]]
    table = markdown_table(["step", "median ms (measured)", "ratio to plain", "target"], rows)
    print(table)
    out = results_dir("overhead")
    config = vars(args)
    write_json(out / "overhead.json", {
        "experiment": "engine overhead vs plain PyTorch", "config": config,
        "median_step_s": {k: measured(v, unit="s") for k, v in med.items()},
        "ratio_never": measured(ratio_never), "ratio_always": measured(ratio_always),
        "steps": {k: v for k, v in times.items()}})
    write_markdown(out / "overhead.md", "# Engine overhead (measured)\n\n"
                   f"MLP {args.depth}x{args.width}, batch {args.batch}, {args.threads} thread(s), "
                   f"median of {args.steps} interleaved steps after {args.warmup} warm-up.\n\n" + table)


if __name__ == "__main__":
    main()
