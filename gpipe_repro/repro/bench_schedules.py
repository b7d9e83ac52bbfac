"""`make bench-schedules`: every schedule of ours against every torch.distributed.pipelining schedule
that applies, on the same cells, data and processes (K=2 stage processes x 1 thread, gloo).

What runs (all measured here; the ideal is computed from measured costs and says so):

- K=1: plain PyTorch, the whole model on the whole batch, one process (rank 0 alone) -> "speedup";
- K=1 on the same M micro-batches (the local runtime, both cells in turn, rank 0 alone): its step
  time / 2 is the ideal 2-process step for that M (the same work split evenly, no bubble, free
  communication) -> "of ideal";
- ours: ``GPipe(..., runtime="distributed", schedule=S)`` for every S in
  :data:`gpipe_repro.engine.schedule.SCHEDULES` (gpipe, 1f1b, zb-h1, and interleaved, zb-v and
  dualpipe-v with the model cut in 4 cells, two per process, like torch's looped and V schedules),
  checkpoint "never";
- torch's: PipelineStage + ScheduleGPipe / Schedule1F1B (one stage per process), and with two
  stages per process (the model cut into 4 chunks) ScheduleInterleaved1F1B, ScheduleLoopedBFS,
  ScheduleInterleavedZeroBubble (chunk c on process c mod 2), ScheduleZBVZeroBubble and
  ScheduleDualPipeV (V shape: process 0 holds chunks 0 and 3). A schedule torch refuses for a
  configuration (e.g. too few micro-batches) is listed as not applicable, with torch's reason.

Every variant of one (batch, M) group runs step by step interleaved with the others in a rotating
order, so drifting load hits all alike; medians after warm-up. Peak memory per stage: measured with
``torch.cuda.max_memory_allocated`` on CUDA only; on CPU the column says "n/a" (no allocator
statistics) and the ours-best / torch-best comparison is made without the memory condition (said in
the output). The host load average is recorded before and after; when it exceeded 0.25 per core
before the run the host was busy, the numbers are not of record and the output says so.
Results: results/schedules/ (JSON, markdown).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from gpipe_repro.models.mlp import synthetic_mlp

TORCH_SINGLE = ("ScheduleGPipe", "Schedule1F1B")
TORCH_LOOPED = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble")
TORCH_V = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def data(cfg: dict[str, Any], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, cfg["width"], generator=g), torch.randint(0, 10, (batch,), generator=g)


class PlainK1:
    """K=1: plain PyTorch on the whole batch."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.model = nn.Sequential(*synthetic_mlp(cfg["width"], cfg["blocks"]))
        self.optimizer, self.loss_fn = sgd(self.model.parameters()), nn.CrossEntropyLoss()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_fn(self.model(x), y).backward()
        self.optimizer.step()


class SameMicrobatchesK1:
    """K=1 on the same M micro-batches: the local runtime, both cells in one process."""

    def __init__(self, cfg: dict[str, Any], m: int) -> None:
        from gpipe_repro import GPipe
        self.pipe = GPipe(synthetic_mlp(cfg["width"], cfg["blocks"]), partitions=2, micro_batches=m,
                          balance=[cfg["blocks"] // 2] * 2, checkpoint="never",
                          loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pipe.train_step(x, y)


class Ours:
    """``GPipe(..., runtime="distributed", schedule=name)``."""

    def __init__(self, cfg: dict[str, Any], m: int, name: str) -> None:
        from gpipe_repro import GPipe
        from gpipe_repro.engine.schedule import cells_per_process
        # interleaved, zb-v and dualpipe-v: 2 cells on each of the 2 processes (the model cut in 4;
        # cell c on process c mod 2 for interleaved, in a V for the others: cells 0 and 3 on process 0)
        k = 2 * cells_per_process(name)
        if cfg["blocks"] % k:
            raise ValueError(f"{cfg['blocks']} blocks do not cut into {k} equal cells")
        self.pipe = GPipe(synthetic_mlp(cfg["width"], cfg["blocks"]), partitions=k, micro_batches=m,
                          balance=[cfg["blocks"] // k] * k, checkpoint="never", schedule=name,
                          loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, runtime="distributed")
        self.pipe.make_schedule()   # the schedule's verdict on M (dualpipe-v: M >= 2K) before any step

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pipe.train_step(x, y)


class Torch:
    """A torch.distributed.pipelining schedule over this rank's stage(s) of the same model."""

    def __init__(self, cfg: dict[str, Any], rank: int, m: int, name: str) -> None:
        from torch.distributed import pipelining
        from torch.distributed.pipelining import PipelineStage

        layers = synthetic_mlp(cfg["width"], cfg["blocks"])
        ranks = 2
        chunks = ranks if name in TORCH_SINGLE else 2 * ranks
        if cfg["blocks"] % chunks:
            raise ValueError(f"{cfg['blocks']} blocks do not cut into {chunks} equal chunks")
        per = cfg["blocks"] // chunks
        if name in TORCH_SINGLE:
            mine = [rank]
        elif name in TORCH_LOOPED:
            mine = [rank, rank + ranks]
        else:
            mine = [rank, chunks - 1 - rank]
        self.modules = [nn.Sequential(*layers[c * per:(c + 1) * per]) for c in mine]
        stages = [PipelineStage(mod, c, chunks, torch.device("cpu")) for mod, c in zip(self.modules, mine)]
        cls = getattr(pipelining, name)
        target = stages[0] if name in TORCH_SINGLE else stages
        self.schedule = cls(target, n_microbatches=m, loss_fn=nn.CrossEntropyLoss())
        self.first, self.last = 0 in mine, chunks - 1 in mine
        self.optimizer = sgd([p for mod in self.modules for p in mod.parameters()])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        args = (x,) if self.first else ()
        kwargs = {"target": y, "return_outputs": False} if self.last else {}
        self.schedule.step(*args, **kwargs)
        self.optimizer.step()


def variants(cfg: dict[str, Any], rank: int, m: int) -> tuple[dict[str, Any], dict[str, str]]:
    """What one (batch, M) group times; and the torch schedules not applicable, with the reason."""
    from gpipe_repro.engine.schedule import SCHEDULES
    items: dict[str, Any] = {"k1_full": PlainK1(cfg) if rank == 0 else None,
                             "k1_same_m": SameMicrobatchesK1(cfg, m) if rank == 0 else None}
    refused = {}
    for name in SCHEDULES:
        try:
            items[f"ours:{name}"] = Ours(cfg, m, name)
        except ValueError as e:   # the engine's verdict on this configuration (the same on every rank)
            refused[f"ours:{name}"] = str(e).splitlines()[0][:200]
    for name in TORCH_SINGLE + TORCH_LOOPED + TORCH_V:
        try:
            items[f"torch:{name}"] = Torch(cfg, rank, m, name)
        except Exception as e:   # torch's own verdict on this configuration (the same on every rank)
            refused[f"torch:{name}"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return items, refused


def bench_processes(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs in each of the 2 processes; returns (start, end) of every timed step of every variant."""
    import torch.distributed as dist

    from gpipe_repro.distributed.process_group import init_distributed

    rank = init_distributed().rank
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    refused_all: dict[str, dict[str, str]] = {}
    peaks: dict[str, list[int]] = {}
    for batch in cfg["batches"]:
        x, y = data(cfg, batch)
        for m in cfg["ms"]:
            group = f"{batch}/{m}"
            items, refused = variants(cfg, rank, m)
            refused_all[group] = refused
            names = list(items)
            for i in range(cfg["warmup"] + cfg["steps"]):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    dist.barrier()
                    t0 = time.perf_counter()
                    if items[name] is not None:
                        items[name].step(x, y)
                    if items[name] is not None and i >= cfg["warmup"]:
                        spans[f"{name}/{group}"].append((t0, time.perf_counter()))
            del items
    return {"spans": dict(spans), "refused": refused_all, "peaks": peaks}


def step_times(per_rank: list[dict[str, Any]], key: str) -> list[float]:
    """Each step's time: last rank to finish minus first to start (one host: one clock)."""
    steps = zip(*[r["spans"][key] for r in per_rank if key in r["spans"]])
    return [max(e for _, e in s) - min(b for b, _ in s) for s in steps]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=8, help="Linear+ReLU layers (a multiple of 4)")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--ms", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes to check that everything runs; numbers are not of record")
    args = ap.parse_args()
    if args.blocks % 4:
        ap.error("--blocks must be a multiple of 4 (2 cells for ours, 4 chunks for torch's looped "
                 "and V schedules)")
    if args.smoke:
        args.width, args.batches, args.steps, args.warmup = 128, [64], 2, 1
    run(args)


def run(args: argparse.Namespace) -> None:
    from gpipe_repro.distributed import launch_local
    from gpipe_repro.report.records import markdown_table, measured, results_dir, write_json, write_markdown

    cfg = dict(vars(args))
    load_before = os.getloadavg()
    cores = os.cpu_count() or 1
    started = time.time()
    print(f"MLP {args.blocks} x Linear({args.width}), batches {args.batches}, M {args.ms}, "
          f"{args.threads} thread(s) per process; load average {load_before[0]:.2f} on {cores} cores",
          flush=True)
    from gpipe_repro.report.host import HostWatch, busy_note, is_clean
    with HostWatch() as watch:     # idle before, other processes' CPU during (not this run's own)
        per_rank = launch_local(bench_processes, 2, cfg, timeout=300, threads=args.threads)
    load_after = os.getloadavg()
    busy = not is_clean(watch.conditions) or args.smoke
    med = statistics.median
    rows, records = [], []
    for batch in args.batches:
        for m in args.ms:
            group = f"{batch}/{m}"
            full = med(step_times(per_rank, f"k1_full/{group}"))
            ideal = med(step_times(per_rank, f"k1_same_m/{group}")) / 2
            times = {}
            for key in per_rank[0]["spans"]:
                name = key[:-len(f"/{group}")]
                if key.endswith(f"/{group}") and name.startswith(("ours:", "torch:")):
                    times[name] = med(step_times(per_rank, key))
            ours = {n: t for n, t in times.items() if n.startswith("ours:")}
            theirs = {n: t for n, t in times.items() if n.startswith("torch:")}
            best_ours, best_torch = min(ours, key=ours.__getitem__), min(theirs, key=theirs.__getitem__)
            for name, t in sorted(times.items(), key=lambda kv: kv[1]):
                rows.append([batch, m, name, t * 1e3, full / t, ideal / t, "n/a"])
            records.append({
                "batch": batch, "micro_batches": m, "k1_full_batch_step_s": measured(full, unit="s"),
                "ideal_step_s_from_k1_same_microbatches_over_2": measured(ideal, unit="s"),
                "step_s": {n: measured(t, unit="s") for n, t in times.items()},
                "speedup": {n: measured(full / t, unit="x") for n, t in times.items()},
                "of_ideal": {n: measured(ideal / t) for n, t in times.items()},
                "ours_best": best_ours, "torch_best": best_torch,
                "ours_best_over_torch_best": measured(theirs[best_torch] / ours[best_ours], unit="x"),
                "not_applicable": per_rank[0]["refused"].get(group, {})})
    ratios = [r["ours_best_over_torch_best"]["value"] for r in records]
    m4 = [max(r["of_ideal"][n]["value"] for n in r["of_ideal"] if n.startswith("ours:"))
          for r in records if r["micro_batches"] == 4]
    checks = {
        "median over (batch, M): ours-best / torch-best throughput (target >= 1.10)": measured(med(ratios)),
        "min over (batch, M): ours-best / torch-best throughput (target >= 1.0)": measured(min(ratios)),
        "M=4: best of ours, fraction of the ideal from measured costs (target >= 0.95)":
            measured(min(m4)) if m4 else None}
    note = (("NOT OF RECORD: smoke run" if args.smoke else "NOT OF RECORD:")
            + busy_note(watch.conditions) + f" (load average before the run {load_before[0]:.2f} / "
            f"{load_before[1]:.2f} (1 / 5 min) on {cores} cores)" if busy
            else f"idle host: idle {watch.conditions['idle_fraction_before']:.0%} before, other "
            f"processes {watch.conditions['others_cpu_fraction_during'] or 0.0:.0%} of the CPU during;"
            f" load average before the run {load_before[0]:.2f} on {cores} cores")
    payload = {"experiment": "schedules: ours vs torch.distributed.pipelining, K=2", "config": cfg,
               "load_average_before": load_before, "load_average_after": load_after, "status": note,
               "host": watch.conditions,
               "peak_memory": "n/a on CPU (no allocator statistics); the best-vs-best comparison is made "
                              "without the equal-or-lower-memory condition",
               "wall_s": time.time() - started, "rows": records, "checks": checks}
    table = markdown_table(["batch", "M", "schedule", "ms/step", "speedup vs K=1", "of ideal",
                            "peak memory/stage"], rows)
    refused = sorted({f"{n}: {why}" for r in records for n, why in r["not_applicable"].items()})
    text = "\n\n".join([f"# Schedules, K=2 stage processes ({note})", table,
                        "Checks:\n" + "\n".join(f"- {k}: {v['value'] if v else 'n/a'}"
                                                for k, v in checks.items()),
                        "Not applicable:\n" + ("\n".join(f"- {x}" for x in refused) or "- none")])
    print(text, flush=True)
    if args.smoke:   # a check that everything runs: nothing is written under results/
        return
    out = results_dir("schedules")
    write_json(out / "bench_schedules.json", payload)
    write_markdown(out / "bench_schedules.md", text)


if __name__ == "__main__":
    main()
