"""`python -m experiments.versus_torch`: our pipeline against torch.distributed.pipelining, best
schedule against best schedule, K=2 stage processes x 1 thread (gloo), by the measurement kernel.

Two parts:

- uniform: the residual MLP of bench-schedules (width 1024, 8 blocks), batch 256 and 1024,
  M = 2, 4, 8, both sides on the same equal cells (:class:`~gpipe_repro.repro.harness.Ours`,
  :class:`~gpipe_repro.repro.harness.TorchSchedule`); target: ours-best / torch-best >= 0.98;
- heterogeneous: AmoebaNet-D, a Transformer LM and a LLaMA-family model
  (:mod:`experiments.versus_models`), each tool used its documented default way: ours,
  ``GPipe(..., sample=micro_batch, sample_target=its targets)`` (cut automatically by measured time,
  the loss with the last layer; the zero-bubble schedules with ``split_backwards="auto"``, their
  split where the same timings say it pays; checkpoint "never", as
  PyTorch's schedules do not re-materialize); PyTorch's, equal blocks
  per stage with the embedding and the head on the end stages (torchtitan's cut). M = 4, 8; target:
  ours-best / torch-best >= 1.10.

Each group runs in two phases of alternating rounds. Selection: every schedule of each side (those
the side refuses for a configuration are listed, with the reason) in ``--select-rounds`` rounds;
the ``--finalists`` fastest of each side by median go on. Record: the finalists alone, in rounds
until their intervals are within tolerance or the group's share of ``--budget`` is spent; with
four items instead of a dozen a round is three times shorter, so the same budget gives three times
the pairs (the figure of record comes from these rounds only, not from the ones that chose them:
no winner's curse; among two finalists per side, the faster by median is each side's best, a
choice made alike on both sides). ``--finalists 0`` keeps every schedule in every round, as one
phase. Ours-best and torch-best are the fastest by median, and their figure is the median of the
per-round paired ratios (torch time / ours time) with its 95% interval. Writes
results/schedules/versus_torch.{json,md} (rows ``model, heterogeneous, K, M, batch, ours_best,
torch_best, ratio, ci_low, ci_high``); it refuses to write the results of record (the checkout's
results/, not $GPIPE_REPRO_RESULTS) from a tree whose tracked files differ from its commit.
``--tiny`` runs tiny sizes in seconds and writes nothing. ``--same-cut`` also times ours on
torchtitan's cut (gpipe and 1f1b, items ``same-cut:S``, not candidates for ours-best) and reports
each against PyTorch's same schedule (``same_cut`` of a row): the runtimes compared apart from the
partition.
"""
from __future__ import annotations

from typing import Any

import torch
import typer

from experiments.command import Budget, MaxRounds, MinRounds, Tolerance
from experiments.versus_models import MODELS, StageChunk, chunk_layers, model, untied
from gpipe_repro.report.measurement import Figure, Measurement, StopRule
from gpipe_repro.repro.harness import (
    TORCH_LOOPED,
    TORCH_SINGLE,
    TORCH_V,
    Ours,
    OursAutoCut,
    TorchSchedule,
    batch,
    check_publish,
    publish,
    rounds_in_processes,
    sgd,
    stop_rule,
)

COMMAND = "versus-torch"
TARGET_UNIFORM, TARGET_HETEROGENEOUS = 0.98, 1.10
UNIFORM = {"width": 1024, "blocks": 8, "batches": [256, 1024], "ms": [2, 4, 8]}
TINY_UNIFORM = {"width": 64, "blocks": 8, "batches": [16], "ms": [2]}
HETEROGENEOUS_MS = [4, 8]


class OursAuto(OursAutoCut):
    """:class:`~gpipe_repro.repro.harness.OursAutoCut` on a heterogeneous model, checkpoint "never"
    (PyTorch's schedules do not re-materialize)."""

    def __init__(self, spec: Any, m: int, schedule: str, x: torch.Tensor, y: torch.Tensor,
                 tiny: bool) -> None:
        super().__init__(spec.build(tiny), spec.loss_fn, m, schedule, x, y)


class OursTorchCut:
    """Ours on torchtitan's cut (:func:`~experiments.versus_models.chunk_layers` with 2 chunks):
    ``GPipe(..., balance=those chunks' lengths, checkpoint="never", runtime="distributed")``, one cell
    per process, the tie kept."""

    def __init__(self, spec: Any, m: int, schedule: str, tiny: bool) -> None:
        from gpipe_repro import GPipe
        layers = spec.build(tiny)
        balance = [len(chunk) for chunk in chunk_layers(layers, 2)]
        self.pipe = GPipe(layers, partitions=2, micro_batches=m, schedule=schedule, balance=balance,
                          checkpoint="never", loss_fn=spec.loss_fn, optimizer=sgd, runtime="distributed")
        self.pipe.make_schedule()
        self.balance = list(self.pipe.balance)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pipe.train_step(x, y)


SAME_CUT = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}   # ours on torchtitan's cut -> torch's


class TorchEqualBlocks(TorchSchedule):
    """A torch.distributed.pipelining schedule over this rank's chunk(s) of torchtitan's cut
    (:func:`~experiments.versus_models.chunk_layers`): 2 chunks, one per process
    (TORCH_SINGLE), or 4, chunk c on process c mod 2 (TORCH_LOOPED) or in a V (TORCH_V). Weights tied
    across chunks are untied (:func:`~experiments.versus_models.untied`)."""

    def __init__(self, spec: Any, rank: int, m: int, name: str, tiny: bool) -> None:
        from torch.distributed import pipelining
        from torch.distributed.pipelining import PipelineStage

        ranks = 2
        chunks = ranks if name in TORCH_SINGLE else 2 * ranks
        mine = ([rank] if name in TORCH_SINGLE else [rank, rank + ranks] if name in TORCH_LOOPED
                else [rank, chunks - 1 - rank])
        cut = chunk_layers(untied(spec.build(tiny)), chunks)
        self.modules = [StageChunk(cut[c]) for c in mine]
        stages = [PipelineStage(mod, c, chunks, torch.device("cpu")) for mod, c in zip(self.modules, mine)]
        target = stages[0] if name in TORCH_SINGLE else stages
        self.schedule = getattr(pipelining, name)(target, n_microbatches=m, loss_fn=spec.loss_fn)
        self.first, self.last = 0 in mine, chunks - 1 in mine
        self.optimizer = sgd([p for mod in self.modules for p in mod.parameters()])


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def group_items(cfg: dict[str, Any], name: str, rank: int, m: int, x: torch.Tensor,
                y: torch.Tensor) -> tuple[dict[str, Any], dict[str, str], dict[str, list[int]]]:
    """What one (model, batch, M) group measures, the schedules not applicable (with the reason), and
    our cuts."""
    from gpipe_repro.engine.schedule import SCHEDULES

    items: dict[str, Any] = {}
    refused: dict[str, str] = {}
    cuts: dict[str, list[int]] = {}
    uniform = cfg["uniform"]
    for s in SCHEDULES:
        try:
            if name == "mlp":
                items[f"ours:{s}"] = Ours(uniform["width"], uniform["blocks"], m, schedule=s)
            else:
                ours = OursAuto(model(name), m, s, x, y, cfg["tiny"])
                items[f"ours:{s}"], cuts[s] = ours, ours.balance
        except ValueError as e:       # the engine's verdict on this configuration (the same everywhere)
            refused[f"ours:{s}"] = _first_line(e)
    if name != "mlp" and cfg.get("same_cut"):
        for s in SAME_CUT:
            items[f"same-cut:{s}"] = OursTorchCut(model(name), m, s, cfg["tiny"])
    for t in TORCH_SINGLE + TORCH_LOOPED + TORCH_V:
        try:
            items[f"torch:{t}"] = (
                TorchSchedule(uniform["width"], uniform["blocks"], rank, m, t) if name == "mlp"
                else TorchEqualBlocks(model(name), rank, m, t, cfg["tiny"]))
        except Exception as e:        # torch's own verdict on this configuration (the same everywhere)
            refused[f"torch:{t}"] = _first_line(e)
    return items, refused, cuts


def groups(cfg: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(model, batch, M) of every group, the uniform MLP's first."""
    uniform = cfg["uniform"]
    out = [("mlp", b, m) for b in uniform["batches"] for m in uniform["ms"]] if cfg["uniform_part"] else []
    for name in cfg["models"]:
        spec = model(name)
        out += [(name, spec.tiny_batch if cfg["tiny"] else spec.batch, m) for m in cfg["ms"]]
    return out


def bench_processes(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs in each of the 2 stage processes: every group's rounds (rank 0 returns the results)."""
    from gpipe_repro.distributed.process_group import broadcast_object, init_distributed

    rank = init_distributed().rank
    rule = StopRule(**cfg["rule"])
    out: dict[str, Any] = {}
    for name, rows, m in groups(cfg):
        if name == "mlp":
            x, y = batch(cfg["uniform"]["width"], rows)
        else:
            x, y = model(name).sample(rows, cfg["tiny"])
        items, refused, cuts = group_items(cfg, name, rank, m, x, y)
        gain = cut_gain(model(name), x, y, m, cfg["tiny"]) if name != "mlp" and rank == 0 else None
        label = f"versus-torch {name} {rows}/{m}"
        selection = None
        if cfg["finalists"]:
            select_rule = StopRule(min_rounds=cfg["select_rounds"], max_rounds=cfg["select_rounds"],
                                   budget_s=rule.budget_s, tolerance=rule.tolerance)
            selection = rounds_in_processes(items, [], select_rule, x, y, warmup=cfg["warmup"],
                                            label=f"{label} selection")
            kept = broadcast_object(finalists(selection, cfg["finalists"]) if selection is not None
                                    else None)
            items = {n: items[n] for n in kept}
        measurement = rounds_in_processes(items, [], rule, x, y,
                                          warmup=0 if cfg["finalists"] else cfg["warmup"], label=label)
        out[f"{name}/{rows}/{m}"] = {"measurement": measurement, "selection": selection,
                                     "refused": refused, "cuts": cuts, "cut_gain": gain}
        if measurement is not None:     # rank 0: the group's row now, in case a later group fails
            row = rows_of({f"{name}/{rows}/{m}": out[f"{name}/{rows}/{m}"]})[0]
            print(f"{COMMAND} {name} batch {rows} M={m}: {row['ours_best']} / {row['torch_best']} "
                  f"{row['ratio']:.3f} [{row['ci_low']}, {row['ci_high']}] ({row['rounds']} rounds); "
                  f"times ms {row['times_ms']}; our cuts {cuts}"
                  + (f"; same cut {row['same_cut']}" if row["same_cut"] else ""), flush=True)
        del items
    return out


def finalists(selection: dict[str, Any], per_side: int) -> list[str]:
    """The items the record's rounds keep: each side's `per_side` fastest by median in the selection
    rounds, and every item timed on torchtitan's cut with PyTorch's same schedule beside it."""
    times = Measurement.from_json(selection).times
    kept = []
    for side in ("ours:", "torch:"):
        kept += sorted((n for n in times if n.startswith(side)), key=lambda n: times[n].value)[:per_side]
    for ours, theirs in SAME_CUT.items():
        if f"same-cut:{ours}" in times and f"torch:{theirs}" in times:
            kept += [f"same-cut:{ours}", f"torch:{theirs}"]
    return list(dict.fromkeys(kept))


def cut_gain(spec: Any, x: torch.Tensor, y: torch.Tensor, m: int, tiny: bool) -> dict[str, Any]:
    """What the cut alone can give at K=2, simulated from per-layer costs measured as ours cuts
    (one micro-batch, the loss with the last layer): torchtitan's cut's bottleneck cell over the
    bottleneck of the best cut by those costs. On a pipeline of equal schedules the step time
    scales with the bottleneck cell, so this is the ratio the runtimes would show if they were
    equally fast; a target above it cannot be met at this K by cutting."""
    from gpipe_repro.engine.layer_costs import layer_costs
    from gpipe_repro.engine.partition import cell_costs, partition

    layers = spec.build(tiny)
    rows = max(1, x.shape[0] // m)
    costs = layer_costs(layers, "time", x[:rows], loss=(spec.loss_fn, y[:rows]))
    theirs = [len(chunk) for chunk in chunk_layers(layers, 2)]
    best = partition(costs, 2, "bottleneck")
    ratio = max(cell_costs(costs, theirs)) / max(cell_costs(costs, best))
    return {"method": "simulated from per-layer costs measured here (one micro-batch, the loss with the "
                      "last layer), separately from the cuts ours ran",
            "torchtitan_cut": theirs, "best_cut": best, "ratio": round(ratio, 3),
            "layer_ms": [round(c * 1e3, 3) for c in costs]}


def best_against_best(result: Measurement, target: float) -> tuple[str, str, Figure]:
    """Ours-best and torch-best (by median time) and their paired ratio per round, torch / ours."""
    ours = min((n for n in result.times if n.startswith("ours:")), key=lambda n: result.times[n].value)
    theirs = min((n for n in result.times if n.startswith("torch:")), key=lambda n: result.times[n].value)
    ratios = [t / o for t, o in zip(result.times[theirs].samples, result.times[ours].samples)]
    return ours, theirs, Figure.of(f"{ours} / {theirs}", ratios, target=target, host_fast=result.host_fast)


def same_cut(result: Measurement) -> dict[str, dict[str, Any]]:
    """Ours on torchtitan's cut against PyTorch's same schedule on it: the paired ratio per round,
    torch / ours (only the schedules timed both ways)."""
    out = {}
    for ours, theirs in SAME_CUT.items():
        a, b = result.times.get(f"same-cut:{ours}"), result.times.get(f"torch:{theirs}")
        if a is None or b is None:
            continue
        ratio = Figure.of(f"same-cut:{ours} / torch:{theirs}", [t / o for t, o in zip(b.samples, a.samples)],
                          host_fast=result.host_fast)
        out[ours] = {"ratio": ratio.value, "ci_low": ratio.low, "ci_high": ratio.high,
                     "ours_ms": round(a.value * 1e3, 2), "torch_ms": round(b.value * 1e3, 2)}
    return out


def rows_of(per_group: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of record, one per group."""
    rows = []
    for group, data in per_group.items():
        name, rows_n, m = group.split("/")
        result = Measurement.from_json(data["measurement"])
        heterogeneous = name != "mlp"
        ours, theirs, ratio = best_against_best(result, TARGET_HETEROGENEOUS if heterogeneous
                                                else TARGET_UNIFORM)
        chosen_from = (Measurement.from_json(data["selection"]) if data.get("selection") is not None
                       else result)
        rows.append({"model": name, "heterogeneous": heterogeneous, "K": 2, "M": int(m), "batch": int(rows_n),
                     "ours_best": ours.removeprefix("ours:"), "torch_best": theirs.removeprefix("torch:"),
                     "ratio": ratio.value, "ci_low": ratio.low, "ci_high": ratio.high,
                     "target": ratio.target, "verdict": ratio.verdict, "rounds": ratio.rounds,
                     "host_fast": ratio.host_fast, "ratio_figure": ratio.to_json(),
                     "times_ms": {n: round(f.value * 1e3, 2) for n, f in result.times.items()},
                     "finalists": sorted(result.times) if chosen_from is not result else None,
                     "selection_rounds": chosen_from.rounds if chosen_from is not result else None,
                     "selection_times_ms": {n: round(f.value * 1e3, 2)
                                            for n, f in chosen_from.times.items()},
                     "our_cuts": data["cuts"], "not_applicable": data["refused"],
                     "cut_gain": data.get("cut_gain"),
                     "same_cut": same_cut(result)})
    return rows


def page(rows: list[dict[str, Any]], tiny: bool, host: dict[str, Any]) -> str:
    from gpipe_repro.report.records import markdown_table

    def cell(x: float | None) -> str:
        return "?" if x is None else f"{x:.2f}"
    table = [[r["model"], "yes" if r["heterogeneous"] else "no", r["K"], r["M"], r["batch"], r["ours_best"],
              r["torch_best"], f"{cell(r['ratio'])}x [{cell(r['ci_low'])}, {cell(r['ci_high'])}]",
              f">= {r['target']:.2f}: {r['verdict']}", r["rounds"],
              "" if r["host_fast"] is None else f"{r['host_fast']:.0%}"] for r in rows]
    cuts = [f"- {r['model']} M={r['M']}: ours " + "; ".join(f"{s} {c}" for s, c in r["our_cuts"].items())
            for r in rows if r["our_cuts"]]
    gains = [f"- {r['model']} M={r['M']}: torchtitan's cut {g['torchtitan_cut']} against the best "
             f"{g['best_cut']}: {g['ratio']:.2f}x" for r in rows if (g := r.get("cut_gain"))]
    same = [f"- {r['model']} M={r['M']}, {s}: ours {v['ours_ms']} ms, torch {v['torch_ms']} ms, ratio "
            f"{cell(v['ratio'])}x [{cell(v['ci_low'])}, {cell(v['ci_high'])}]"
            for r in rows for s, v in r.get("same_cut", {}).items()]
    selection = [f"- {r['model']} batch {r['batch']} M={r['M']}: " + ", ".join(
        f"{n} {t}" for n, t in sorted(r["selection_times_ms"].items(), key=lambda kv: kv[1]))
        for r in rows if r.get("finalists")]
    refused = sorted({f"{r['model']} M={r['M']}, {n}: {why}"
                      for r in rows for n, why in r["not_applicable"].items()})
    models = "\n".join(f"- {spec.name}: {spec.description}" for spec in MODELS.values())
    return "\n\n".join([
        "# Ours against torch.distributed.pipelining, best schedule against best, K=2 (measured"
        + (", TINY RUN: not of record)" if tiny else ")"),
        "ratio = torch-best step time / ours-best step time, the median over alternating rounds with its "
        "95% interval (a busy host widens it; the verdict is met only where the interval's "
        "lower bound reaches the target). "
        + (f"Each group's schedules ran {rows[0]['selection_rounds']} alternating selection round(s) "
           f"together; the {sum(n.startswith('ours:') for n in rows[0]['finalists'])} fastest of each "
           "side by median went on alone to the rounds of record "
           "(`rounds`), which give every figure here (none from the rounds that chose them); "
           "`selection` lists each schedule's median step in the selection rounds. "
           if rows and rows[0].get("finalists") else "")
        + "Uniform: the MLP of bench-schedules on the same equal cells "
        "both sides. Heterogeneous: ours cut automatically by measured time (`GPipe(..., sample=x, "
        "sample_target=y)`, the loss timed with the last layer; zero bubble with "
        "`split_backwards=\"auto\"`, its split where those timings say it pays); "
        "PyTorch's by torchtitan's rule, equal blocks per stage, embedding (stem) and head on the end "
        "stages; the tied LLaMA embedding is untied on PyTorch's side. Ours keeps BatchNorm's "
        "running statistics equal to full-batch training (DeferredBatchNorm: one commit per step); "
        "PyTorch's BatchNorm updates them per micro-batch, which costs less (on AmoebaNet-D at 2-image "
        "micro-batches ours measured about 1.1x its plain-BatchNorm step, K=1, alternating rounds).",
        f"Host: {host.get('cores')} cores, load average {host.get('load')} at the start; commit "
        f"{str(host.get('git_commit'))[:10]}{' (dirty)' if host.get('git_dirty') else ''}.",
        markdown_table(["model", "heterogeneous", "K", "M", "batch", "ours best", "torch best", "ratio [95%]",
                        "target", "rounds", "host fast"], table),
        "Models:\n" + models, "Our cuts (layers per cell):\n" + ("\n".join(cuts) or "- none"),
        *(["What the cut alone can give at K=2 (simulated: the bottleneck cell of torchtitan's cut over "
           "that of the best cut, from per-layer costs measured as ours cuts, one micro-batch, the "
           "loss with the last layer, in a measurement of their own, so its best cut may differ from "
           "the cuts above by the timing's noise; the ratio equally fast runtimes would show, the "
           "ceiling of a lead that comes from the partition):\n" + "\n".join(gains)] if gains else []),
        *(["Ours on torchtitan's cut against PyTorch's same schedule (torch / ours):\n" + "\n".join(same)]
          if same else []),
        *(["Selection rounds, each schedule's median step (ms), fastest first:\n" + "\n".join(selection)]
          if selection else []),
        "Not applicable:\n" + ("\n".join(f"- {x}" for x in refused) or "- none")])


app = typer.Typer(add_completion=False)


@app.command()
def main(models: str = typer.Option(",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}"),
         uniform: bool = typer.Option(True, "--uniform/--no-uniform", help="the uniform MLP's rows"),
         ms: str = typer.Option(",".join(map(str, HETEROGENEOUS_MS)),
                                help="micro-batches of the heterogeneous models, comma-separated"),
         warmup: int = typer.Option(1, min=0, help="untimed steps before the rounds"),
         same_cut_part: bool = typer.Option(False, "--same-cut/--no-same-cut",
                                            help="also time ours on torchtitan's cut (gpipe, 1f1b) "
                                            "against PyTorch's same schedule"),
         finalists_per_side: int = typer.Option(2, "--finalists", min=0,
                                                help="schedules of each side that the rounds of record "
                                                "keep after the selection rounds (0: every schedule "
                                                "in every round)"),
         select_rounds: int = typer.Option(3, min=1, help="rounds of every schedule that choose the "
                                           "finalists"),
         tiny: bool = typer.Option(False, "--tiny", help="tiny sizes and rounds to check that everything "
                                   "runs (seconds); nothing is written"),
         budget: Budget = 600.0, tolerance: Tolerance = 0.02, min_rounds: MinRounds = 5,
         max_rounds: MaxRounds = 30) -> None:
    """Ours against torch.distributed.pipelining, best schedule against best, K=2."""
    chosen = [m for m in models.split(",") if m]
    unknown = sorted(set(chosen) - set(MODELS))
    if unknown:
        raise typer.BadParameter(f"{', '.join(unknown)}: use some of {', '.join(MODELS)}",
                                 param_hint="--models")
    try:
        micro = [int(m) for m in ms.split(",") if m]
    except ValueError as e:
        raise typer.BadParameter(f"{ms!r}: give whole numbers, e.g. 4,8", param_hint="--ms") from e
    if tiny:
        budget, min_rounds, max_rounds, micro, select_rounds = 10.0, 3, 3, [2], 1
    from gpipe_repro.report.host import usable_cores
    from gpipe_repro.report.provenance import git_state

    host = {**git_state(), "cores": usable_cores(), "load": round(_load(), 2)}
    write = not tiny
    check_publish("schedules", "versus_torch", COMMAND, write=write)
    cfg: dict[str, Any] = {"models": chosen, "uniform_part": uniform, "ms": micro, "tiny": tiny,
                           "warmup": warmup, "same_cut": same_cut_part, "finalists": finalists_per_side,
                           "select_rounds": select_rounds,
                           "uniform": TINY_UNIFORM if tiny else UNIFORM}
    rule = stop_rule(budget, tolerance, min_rounds, max_rounds, groups=len(groups(cfg)))
    cfg["rule"] = vars(rule)
    from gpipe_repro.distributed import launch_local
    per_rank = launch_local(bench_processes, 2, cfg, timeout=600, threads=1)
    rows = rows_of(per_rank[0])
    text = page(rows, tiny, host)
    payload = {"experiment": "ours vs torch.distributed.pipelining, best vs best, K=2", "config": cfg,
               "host": host, "rows": rows}
    publish("schedules", "versus_torch", payload, text, command=COMMAND, write=write)


def _load() -> float:
    import os
    return os.getloadavg()[0]


if __name__ == "__main__":
    app()
