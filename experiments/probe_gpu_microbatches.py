"""Probe: per-micro-batch cost of the headline model on a GPU, engine against plain PyTorch.

`gpipe-repro run amoebanet --k 4 --m 32 --device cuda` trains AmoebaNet-B (3, 16) on 28x28 MNIST
with micro-batches of 8 examples: far too little work per kernel for a GPU, so a step costs what
its kernel launches cost. This probe says how much of that is the engine: it times, on one device,
a plain full-batch step, a plain gradient-accumulation loop over the same 32 micro-batches, and
GPipe at K=1/K=4, M=1/M=32 (all cells on the one device, so the K cells run one after another).

    python experiments/probe_gpu_microbatches.py --device cuda:0
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from gpipe_repro import GPipe
from gpipe_repro.models.amoebanet import amoebanet, amoebanet_loss


def build() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return amoebanet(3, 16, "B", 10, in_channels=1, dropout=0.2, drop_path=0.1, aux_head=True,
                     image_size=28)


def timed(step, device: torch.device, warmup: int, steps: int) -> float:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    x = torch.randn(args.batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    rows: dict[str, float] = {}

    model = build().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def plain(m: int):
        def step() -> None:
            opt.zero_grad()
            for xs, ys in zip(x.chunk(m), y.chunk(m)):
                (amoebanet_loss(model(xs), ys) * len(ys) / len(y)).backward()
            opt.step()
        return step

    rows["plain, full batch"] = timed(plain(1), device, args.warmup, args.steps)
    rows["plain, 32 micro-batches accumulated"] = timed(plain(32), device, args.warmup, args.steps)
    for k, m, mode in ((1, 1, "never"), (1, 32, "never"), (4, 32, "never"), (4, 32, "except_last"),
                       (4, 32, "always")):
        pipe = GPipe(build(), partitions=k, micro_batches=m, checkpoint=mode, devices=[device] * k,
                     loss_fn=amoebanet_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
        rows[f"GPipe K={k} M={m} checkpoint={mode}"] = timed(lambda p=pipe: p.train_step(x, y), device,
                                                              args.warmup, args.steps)
    base = rows["plain, 32 micro-batches accumulated"]
    print(f"{'configuration':<42} {'ms/step':>9} {'vs plain M=32':>14}")
    for name, s in rows.items():
        print(f"{name:<42} {s * 1e3:9.1f} {s / base:14.2f}")
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "load_average": os.getloadavg()}
    print(json.dumps({"env": env, "seconds_per_step": rows}))


if __name__ == "__main__":
    main()
