"""`gpipe-repro fit` and `gpipe-repro plan`: per-device memory, before buying the devices.

    gpipe-repro fit transformer-lm --L 1663 --k 128 --m 8 --memory 16    # 84B parameters: fits?
    gpipe-repro fit amoebanet-d --L 18 --F 416 --k 1 --m 8 --memory 8 --batch-size 128
    gpipe-repro plan transformer-lm --L 48 --devices 8 --memory 16 --link nvlink
    gpipe-repro plan hf:llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --vocab 128256 \\
        --intermediate 14336 --seq-len 2048 --batch-size 32 --devices 16 --memory 80   # an 8B LLaMA
    gpipe-repro fit path/to/config.json --k 4 --m 8 --memory 40            # a Hugging Face config

``fit`` answers "does this model fit on K devices of X GiB with M micro-batches, and what is each
device's peak?", and when it does not, says why and what would fit (re-materialization, more
micro-batches, more devices). ``plan`` chooses K, M, the schedule (``--schedules``, default every
one that applies: gpipe, 1f1b, interleaved, zb-h1, zb-v) and the memory-capped partition that maximize
simulated throughput under the budget, and says why each other schedule lost. Model options are
those of ``gpipe-repro models`` (any
builder keyword, e.g. ``--L 24 --d-model 1024``), plus ``--seq-len`` (language models) and
``--image-size`` (AmoebaNet). A Hugging Face causal LM is ``hf:<family>`` (its transformers model_type: any
decoder family the engine pipelines, e.g. llama, mistral, qwen2, qwen3, gemma, gemma2, granite, phi3,
gpt2, gpt_neox) with size options (``--layers --hidden --heads --kv-heads --intermediate
--head-dim --vocab --positions``, or any attribute of the family's config by its name), or the path
of its ``config.json``; its batch is ``--batch-size`` sequences (default 32) of ``--seq-len`` tokens
(default 2048, at most the model's positions). Models are built on the meta device and measured on
fake tensors: nothing is allocated, whatever the size. All numbers are simulated by the memory planner.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from gpipe_repro.commands.options import (
    EXPERIMENTS,
    HELP,
    as_flags,
    check_out_files,
    int_list,
    one_of,
    positive,
    positive_number,
)

_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}
MODEL_HELP = ("the model: a family of the paper's (transformer-lm, amoebanet-d, amoebanet-b, gpt2), "
              "hf:<family> (a transformers "
              "model_type the engine pipelines: llama, mistral, qwen2, qwen3, gemma, gemma2, granite, phi3, "
              "gpt2, gpt_neox, ...) with --layers --hidden --heads --kv-heads --intermediate "
              "--vocab, or a Hugging Face config.json; size options follow it, each with a default (a "
              "Hugging Face family's batch: --batch-size 32 sequences of --seq-len 2048 tokens, at "
              "most its positions, unless given; the paper's models keep their own sizes; the "
              "plan's header says what it planned)")


OPTIMIZER_HELP = ("the optimizer the training runs, for its state: sgd, momentum, rmsprop, adam, adamw "
                  "(default rmsprop, the paper's)")


def optimizer_state(name: str) -> str:
    """What a plan says it assumed of the optimizer (memory.profile.OPTIMIZERS)."""
    from gpipe_repro.memory.profile import OPTIMIZERS
    _, title, state = OPTIMIZERS[name]
    return f"optimizer state as {title}'s (weight + gradient + {state})"


def check_optimizer(name: str) -> None:
    """Refuse an --optimizer the plans do not know (before any work)."""
    from gpipe_repro.memory.profile import OPTIMIZERS
    one_of("--optimizer", name, tuple(OPTIMIZERS))


def _planner(family: str, batch: Optional[int], extra: list[str], attention: str,
             command: str = "fit", optimizer: str = "rmsprop") -> tuple[Any, Any]:
    from gpipe_repro.commands._hf_models import hf_workload, is_hf_model
    from gpipe_repro.commands.models import parse_options
    from gpipe_repro.memory.planner import MemoryPlanner
    from gpipe_repro.memory.profile import OPTIMIZERS
    from gpipe_repro.memory.workloads import SUPPORTED, workload
    if not is_hf_model(family) and family not in SUPPORTED:
        own = (" A model of your own (module:function) is simulated by `gpipe-repro throughput "
               f"--model {family}`; in Python, gpipe_repro.memory.planner.MemoryPlanner(layers, "
               "sample, target, loss_fn).plan(K, M) plans its memory" if ":" in family else "")
        from gpipe_repro.models import FAMILIES
        listed = (f" ({family} is a family of `gpipe-repro models`, whose layers it shows; the memory "
                  "planner takes only these)" if family in FAMILIES else "")
        raise typer.BadParameter(f"unknown model {family!r}{listed}: use one of {', '.join(SUPPORTED)}, "
                                 "hf:<family> with size options (hf:llama --layers 32 ...), or the "
                                 f"path of a Hugging Face config.json.{own}")
    try:
        options = parse_options(extra)
        work = hf_workload(family, batch, options) if is_hf_model(family) else \
            workload(family, batch, **options)
        layers, sample, target, loss_fn = work.planner_inputs()   # a bad size (--L 0) fails here
    except (ValueError, TypeError) as e:
        where = (f"`gpipe-repro {command}` passes the options it does not take itself to the model, "
                 "and " if "has no option" in str(e) else "")
        raise typer.BadParameter(f"{where}{e}" + (f" (`gpipe-repro {command} --help` lists the "
                                                  "command's own)" if where else "")) from e
    planner = MemoryPlanner(layers, sample, target, loss_fn, optimizer=OPTIMIZERS[optimizer][0],
                            attention=attention, optimizer_foreach=True)
    return work, planner


def _is_fit_output(data: Any) -> bool:
    """A `fit --out` file written before outputs were stamped."""
    return {"model", "budget_gib", "fits", "plan", "advice"} <= set(data)


def _is_plan_output(data: Any) -> bool:
    """A `plan --out` file written before outputs were stamped."""
    return {"model", "budget_gib", "devices", "choice", "candidates"} <= set(data)


def _check_json_out(path: Optional[Path], command: str, overwrite: bool) -> None:
    """Refuse, before any work, an --out that would replace a file that is not this command's own
    previous output, or its own without --overwrite."""
    if path is None:
        return
    from gpipe_repro.report.output_guard import owned_json
    legacy = _is_fit_output if command == "fit" else _is_plan_output
    check_out_files("--out", [path], command, overwrite=overwrite,
                    own=lambda p: owned_json(p, command, legacy))


def _write_json_out(path: Path, command: str, payload: dict[str, Any]) -> None:
    from gpipe_repro.report.output_guard import stamp
    from gpipe_repro.report.records import atomic_write
    with atomic_write(path) as f:          # parents created; a failure leaves no half file
        f.write(json.dumps(stamp(payload, command), indent=2) + "\n")


def _device_rows(plan: Any) -> list[tuple[str, Any, int]]:
    """Consecutive devices with equal peaks and layer counts shown as one row."""
    rows: list[tuple[str, Any, int]] = []
    start = 0
    stages = plan.stages
    for i in range(1, len(stages) + 1):
        if i == len(stages) or (stages[i].peak, plan.balance[i]) != (stages[start].peak, plan.balance[start]):
            name = str(start) if i - start == 1 else f"{start}..{i - 1}"
            rows.append((name, stages[start], plan.balance[start]))
            start = i
    return rows


def _print_plan(plan: Any, budget: float, title: str) -> None:
    """Each device's peak and what fills it; where a device runs several cells (interleaved, zb-v,
    dualpipe-v), each cell's, then each device's: its cells' actions walked together."""
    from rich.table import Table

    from gpipe_repro.memory.planner import gib
    from gpipe_repro.report.terminal import table_console
    cats = {"params": "param", "grads": "grad", "optimizer": "optim", "stash": "stash",
            "activations": "activ", "data": "data"}
    owner = plan.device_of_cells
    several = len(plan.device_peaks) != len(plan.stages)
    rows = ([(f"{s.stage} (device {owner[s.stage]})", s, plan.balance[s.stage]) for s in plan.stages]
            if several else _device_rows(plan))
    table = Table("cell" if several else "device", "layers", "peak", *cats.values(), "when", "fits",
                  title=title, caption=f"GiB; 'when': the action at the {'cell' if several else 'device'}'s "
                  "peak")
    for name, s, layers in rows:
        table.add_row(name, str(layers), gib(s.peak),
                      *[gib(s.parts.get(c, 0)) for c in cats], s.peak_at,
                      "-" if several else "yes" if s.peak <= budget else "NO")
    console = table_console()
    console.print(table)
    if several:
        console.print("device peaks, GiB (each device's cells walked together): "
                      + ", ".join(f"{d}: {gib(p)}{'' if p <= budget else ' (NO)'}"
                                  for d, p in enumerate(plan.device_peaks)), soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command(context_settings=_CONTEXT)
    def fit(ctx: typer.Context,
            family: str = typer.Argument(..., help=MODEL_HELP),
            k: int = typer.Option(1, "--k", "-k", help=HELP["k"]),
            m: int = typer.Option(8, "--m", "-m", help=HELP["m"]),
            memory: float = typer.Option(16.0, "--memory", help=HELP["memory"]),
            batch_size: Optional[int] = typer.Option(None, "--batch-size", help=HELP["batch_size"]
                                                     + " (default: the paper's for the family)"),
            checkpoint: str = typer.Option("except_last", "--checkpoint",
                                           help="re-materialization: except_last | always | never"),
            attention: str = typer.Option("fused", "--attention", help="fused | math (materialized)"),
            optimizer: str = typer.Option("rmsprop", "--optimizer", help=OPTIMIZER_HELP),
            schedule: str = typer.Option("gpipe", "--schedule", help="pipeline schedule: gpipe | 1f1b | "
                                         "interleaved | zb-h1 | zb-v | dualpipe-v (interleaved, zb-v "
                                         "and dualpipe-v run 2 of the K cells per device)"),
            split_backwards: Optional[int] = typer.Option(
                None, "--split-backwards", help="zb-h1, zb-v, dualpipe-v: only the last N micro-batches "
                "split their backwards (default: all, as GPipe(schedule=...) runs them)"),
            balance: Optional[str] = typer.Option(None, "--balance", help="layers per cell, "
                                                  "e.g. 3,4,4,3 (default: memory-balanced)"),
            engine: bool = typer.Option(False, "--engine", help="also run the engine's own train_step "
                                        "on fake tensors and show its per-device peaks (slow: every "
                                        "layer of every micro-batch runs)"),
            out: Optional[Path] = typer.Option(None, "--out", help="also write the plan here (JSON)"),
            overwrite: bool = typer.Option(False, "--overwrite", help="replace an earlier `fit` output "
                                           "at --out (any other existing file is refused)"),
            ) -> None:
        """Does the model fit on K devices of --memory GiB with M micro-batches? Each device's peak.
        Exit code 0 if it fits, 1 if it does not."""
        # K is GPipe's `partitions` (cells): K devices, or K/2 for the schedules with 2 cells per device.
        from gpipe_repro.memory.advice import what_would_fit, why
        from gpipe_repro.memory.planner import GiB, gib
        from gpipe_repro.report.terminal import table_console
        partitions, micro_batches, batch, json_out = k, m, batch_size, out
        positive("--k", partitions, "devices")
        positive("--m", micro_batches, "micro-batches")
        positive("--batch-size", batch)
        positive_number("--memory", memory, "GiB")
        one_of("--attention", attention, ("fused", "math"))
        check_optimizer(optimizer)
        cuts = int_list("--balance", balance, "3,4,4,3") if balance else None
        try:    # the schedule's own rules (M, K, the split count) before any model is built
            from gpipe_repro.engine.schedule import make_schedule
            make_schedule(schedule, partitions, micro_batches, checkpoint, split_backwards=split_backwards)
        except ValueError as e:
            raise typer.BadParameter(as_flags(str(e))) from e
        _check_json_out(json_out, "fit", overwrite)
        work, planner = _planner(family, batch, list(ctx.args), attention, optimizer=optimizer)
        budget = memory * GiB
        try:
            plan = planner.plan(partitions, micro_batches, checkpoint, balance=cuts, schedule=schedule,
                                split_backwards=split_backwards, budget=budget)
        except ValueError as e:
            raise typer.BadParameter(as_flags(str(e))) from e
        console = table_console()
        console.print(f"{work.describe()}: {planner.parameters:,} parameters, "
                      f"{planner.num_layers} layers; {optimizer_state(optimizer)}", soft_wrap=True)
        split = "" if split_backwards is None else f" (last {split_backwards} backwards split)"
        _print_plan(plan, budget, f"K={partitions}, M={micro_batches}, checkpoint={checkpoint}, "
                                  f"schedule={schedule}{split}, {memory:g} GiB per device (simulated)")
        if engine:
            from gpipe_repro.memory.trace import trace_step
            layers, sample, target, loss_fn = work.planner_inputs()
            traced = trace_step(layers, sample, target, loss_fn, partitions,
                                micro_batches, checkpoint, balance=plan.balance,
                                optimizer=planner.optimizer, schedule=schedule, fake=True,
                                attention=attention, split_backwards=split_backwards)
            data = [s.parts.get("data", 0) for s in plan.stages]
            several = len(plan.device_peaks) != len(plan.stages)
            console.print(f"engine on fake tensors, peak GiB per {'cell' if several else 'device'} "
                          "(data excluded): "
                          + ", ".join(f"{t.peak / GiB:.4f} (planner {(s.peak - d) / GiB:.4f})"
                                      for t, s, d in zip(traced.stages, plan.stages, data)),
                          soft_wrap=True)
        advice: list[str] = []
        if plan.fits(budget):
            console.print(f"[green]fits[/green]: largest device peak {gib(plan.max_peak)} GiB "
                          f"of {memory:g} GiB")
        else:
            console.print(f"[red]does not fit[/red]: {why(plan, budget)}")
            advice = what_would_fit(planner, plan, budget)
            for line in advice:
                console.print(f"  - {line}")
        if json_out:
            _write_json_out(json_out, "fit", {"model": work.describe(), "budget_gib": memory,
                                              "optimizer": optimizer,
                                              "fits": plan.fits(budget), "plan": plan.to_dict(),
                                              "advice": advice, "method": "simulated"})
        if not plan.fits(budget):
            raise typer.Exit(1)

    @app.command(context_settings=_CONTEXT)
    def plan(ctx: typer.Context,
             family: str = typer.Argument(..., help=MODEL_HELP),
             devices: int = typer.Option(8, "--devices", help=HELP["devices"]),
             memory: float = typer.Option(16.0, "--memory", help=HELP["memory"]),
             batch_size: Optional[int] = typer.Option(None, "--batch-size", help=HELP["batch_size"]
                                                      + " (default: the paper's for the family)"),
             link: str = typer.Option("nvlink", "--link", help="link model: ideal, pcie, nvlink, "
                                      "tpu-ici, gloo-loopback"),
             tflops: float = typer.Option(100.0, "--tflops", help="device compute rate, TFLOP/s"),
             m: Optional[str] = typer.Option(None, "--m", "-m", help="M candidates, e.g. 4,8,32 (default: "
                                              "powers of two up to the batch)"),
             attention: str = typer.Option("fused", "--attention", help="fused | math"),
             optimizer: str = typer.Option("rmsprop", "--optimizer", help=OPTIMIZER_HELP),
             top: int = typer.Option(8, "--top", help="candidates to show"),
             schedules: Optional[str] = typer.Option(
                 None, "--schedules", help="schedules to choose from, e.g. gpipe,1f1b (default: "
                 "gpipe,1f1b,interleaved,zb-h1,zb-v, each where it applies)"),
             out: Optional[Path] = typer.Option(None, "--out", help="also write the choice here (JSON)"),
             overwrite: bool = typer.Option(False, "--overwrite", help="replace an earlier `plan` "
                                            "output at --out (any other existing file is refused)"),
             ) -> None:
        """Choose K, M, the schedule and the partition that maximize simulated throughput within
        --memory GiB. Exit code 0 if a configuration fits, 1 if none does."""
        micro_batches, batch, json_out = m, batch_size, out
        positive("--devices", devices, "devices available")
        positive("--batch-size", batch)
        positive("--top", top)
        positive_number("--memory", memory, "GiB")
        positive_number("--tflops", tflops, "TFLOP/s")
        from gpipe_repro.sim.links import LINK_NAMES
        one_of("--link", link, LINK_NAMES)
        one_of("--attention", attention, ("fused", "math"))
        check_optimizer(optimizer)
        ms = int_list("--m", micro_batches) if micro_batches else None
        if ms is not None and min(ms) < 1:
            raise typer.BadParameter(f"--m candidates must be >= 1, got {micro_batches}")
        from gpipe_repro.engine.schedule import SCHEDULES, cells_per_process
        names = ([x.strip() for x in schedules.split(",") if x.strip()] if schedules is not None
                 else ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
        unknown = [x for x in names if x not in SCHEDULES]
        if unknown or not names:
            from gpipe_repro.engine.choices import did_you_mean
            close = did_you_mean(unknown[0], SCHEDULES) if unknown else ""
            raise typer.BadParameter(f"--schedules takes names from {','.join(sorted(SCHEDULES))} "
                                     f"separated by commas, got {schedules!r}{close}")
        _check_json_out(json_out, "plan", overwrite)
        from rich.table import Table

        from gpipe_repro.memory.advice import what_would_fit, why
        from gpipe_repro.memory.autoplan import schedule_verdict, search
        from gpipe_repro.memory.planner import GiB, gib
        from gpipe_repro.report.terminal import table_console
        from gpipe_repro.sim.links import get_link
        work, planner = _planner(family, batch, list(ctx.args), attention, "plan", optimizer)
        if ms is not None and max(ms) > planner.batch:
            raise typer.BadParameter(f"--m candidates must be at most the batch size {planner.batch}, got "
                                     f"{micro_batches}: use a larger --batch-size or smaller M")
        budget = memory * GiB
        from gpipe_repro.memory.profile import LayerNotTraceable
        left_out: dict[int, str] = {}
        try:
            cands = search(planner, devices, budget, get_link(link), tflops * 1e12, ms, schedules=names,
                           left_out=left_out)
        except LayerNotTraceable as e:
            raise typer.BadParameter(f"{family}: {e}") from None
        console = table_console()
        console.print(f"{work.describe()}: {planner.parameters:,} parameters, "
                      f"{planner.num_layers} layers; {devices} devices of {memory:g} GiB, "
                      f"{tflops:g} TFLOP/s, link {link}; {optimizer_state(optimizer)} (simulated)",
                      soft_wrap=True)
        several = [x for x in names if cells_per_process(x) > 1]
        table = Table("K", "M", "schedule", "checkpoint", "fits", "peak GiB", "samples/s", "bubble",
                      "balance", title="fastest configurations, those that fit first",
                      caption=(f"{', '.join(several)}: 2 cells per device, peak = the two walked "
                               "together") if several else None)
        for c in cands[:top]:
            cuts = ",".join(map(str, c.balance)) if len(c.balance) <= 8 else f"{len(c.balance)} cells"
            table.add_row(str(c.partitions), str(c.micro_batches), c.schedule, c.checkpoint,
                          "yes" if c.fits else "no", gib(c.max_peak) if c.max_peak else "-",
                          f"{c.throughput:.1f}" if c.fits else "-",
                          f"{c.bubble:.2f}" if c.fits else "-", cuts)
        console.print(table)
        for reason in left_out.values():
            console.print(f"not planned: {reason}", soft_wrap=True)
        best = cands[0] if cands and cands[0].fits else None
        if best is not None:
            cells = len(best.balance)
            devices_of = (f" devices of {cells} cells (fit --k {cells}; GPipe partitions={cells})"
                          if cells != best.partitions else "")
            console.print(f"[green]choose[/green] K={best.partitions}{devices_of}, M={best.micro_batches}, "
                          f"schedule={best.schedule}, checkpoint={best.checkpoint}, "
                          f"balance={best.balance}: {best.throughput:.1f} samples/s, largest device "
                          f"peak {gib(best.max_peak)} GiB", soft_wrap=True)
        verdict = schedule_verdict(cands, names, budget)
        if len(names) > 1:
            console.print("schedules (best fitting configuration of each):")
            for line in verdict:
                console.print(f"  - {line}", soft_wrap=True)
        if not cands:
            from gpipe_repro.memory.autoplan import device_counts, micro_batch_candidates, why_none_applies
            tried = micro_batch_candidates(planner, ms, {})
            console.print(f"[red]nothing to plan[/red]: none of the K tried "
                          f"({', '.join(map(str, device_counts(devices)))}) and M "
                          f"({', '.join(map(str, tried))}) can run {', '.join(names)}; the schedules' "
                          "rules, not memory (change --devices, --m or --schedules):", soft_wrap=True)
            for line in why_none_applies(devices, tried, names, planner.num_layers):
                console.print(f"  - {line}", soft_wrap=True)
        elif best is None:
            console.print(f"[red]nothing fits[/red] on up to {devices} devices of {memory:g} GiB.")
            closest = min((c for c in cands if c.plan is not None
                           and cells_per_process(c.schedule) == 1),
                          key=lambda c: c.max_peak, default=None)
            if closest is not None and closest.plan is not None:
                console.print(f"closest: K={closest.partitions}, M={closest.micro_batches}, "
                              f"schedule={closest.schedule}, checkpoint={closest.checkpoint}: "
                              f"{why(closest.plan, budget)}")
                for line in what_would_fit(planner, closest.plan, budget,
                                           max_partitions=planner.num_layers):
                    console.print(f"  - {line}")
        if json_out:
            _write_json_out(json_out, "plan", {
                "model": work.describe(), "budget_gib": memory, "devices": devices, "link": link,
                "tflops": tflops, "optimizer": optimizer, "method": "simulated", "schedules": names,
                "schedule_verdict": verdict,
                "choice": None if best is None else {
                    "partitions": best.partitions, "micro_batches": best.micro_batches,
                    "schedule": best.schedule, "checkpoint": best.checkpoint, "balance": best.balance,
                    "throughput": best.throughput, "max_peak_bytes": best.max_peak,
                    # GPipe's own arguments: its `partitions` counts cells (2 per device for a V
                    # schedule, v for interleaved), where `partitions` above counts devices
                    "gpipe_arguments": {"partitions": len(best.balance), "balance": best.balance,
                                        "micro_batches": best.micro_batches, "schedule": best.schedule,
                                        "checkpoint": best.checkpoint}},
                "candidates": [{"partitions": c.partitions, "micro_batches": c.micro_batches,
                                "schedule": c.schedule, "checkpoint": c.checkpoint, "fits": c.fits,
                                "max_peak_bytes": c.max_peak, "throughput": c.throughput,
                                "note": c.note} for c in cands]})
        if best is None:
            raise typer.Exit(1)

    @app.command("memory-table", rich_help_panel=EXPERIMENTS)
    def memory_table(
            m: int = typer.Option(8, "--m", "-m", help=HELP["m"] + " of every pipeline row (the paper "
                                  "does not state it)"),
            amoebanet: bool = typer.Option(True, "--amoebanet/--no-amoebanet",
                                           help="the AmoebaNet rows (the slowest)"),
            out: Optional[Path] = typer.Option(None, "--out", help="output directory (default: "
                                               "results/memory, under $GPIPE_REPRO_RESULTS when set)"),
            overwrite: bool = typer.Option(False, "--overwrite", help="replace an earlier table in --out"),
            wandb: bool = typer.Option(True, "--wandb/--no-wandb", help="log to W&B"),
            record: bool = typer.Option(False, "--record", help="may replace the results of record "
                                        "(what `make memory-table` does)"),
    ) -> None:
        """The paper's Table 1 (maximum model size) from the memory planner, checked against real
        steps on this CPU."""
        from gpipe_repro.report.output_guard import OutputRefused
        from gpipe_repro.repro import memory_table as table
        positive("--m", m, "micro-batches")
        try:
            table.main(micro_batches=m, amoebanet=amoebanet, out=out, overwrite=overwrite, record=record,
                       wandb=wandb)
        except OutputRefused as e:
            raise typer.BadParameter(str(e), param_hint="--out") from None
