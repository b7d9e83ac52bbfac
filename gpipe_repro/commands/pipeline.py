"""`gpipe-repro pipeline`: one process per stage, training a synthetic wide MLP; prints the losses and
step times, and writes the merged timeline (JSON) and its Gantt chart (PNG) of the last step, to a
fresh runs/pipeline-N (or --out DIR, or --timeline / --gantt files).

    gpipe-repro pipeline --k 2 --m 8                       # runs/pipeline/{timeline.json,gantt.png}
    torchrun --nproc-per-node 2 -- .venv/bin/gpipe-repro pipeline --launcher torchrun --m 4
    gpipe-repro pipeline --fail-mode kill --fail-rank 1 --timeout 5    # watch a failure end the job

It is the smallest end-to-end check of the distributed runtime on a machine: processes, transport,
timeline and failure handling. Under torchrun, `--` ends torchrun's options: without it, torchrun's
own parser reads `--m` as an abbreviation of one of its options and refuses it. Every rank builds the
same model and data (seeded), which is how a torchrun script feeds a pipeline. Files are written by
rank 0 only after every step succeeded, and atomically; a failed job exits non-zero with the failing
rank and its cause on stderr.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import typer

from gpipe_repro.commands.options import HELP, check_out_files, positive, positive_number

LAUNCHERS = ("local", "torchrun")
COMMAND = "pipeline"


def _is_timeline(data: Any) -> bool:
    """A timeline file this command wrote before outputs were stamped."""
    return {"method", "options", "timeline"} <= set(data)


def check_outputs(timeline: Optional[Path], gantt: Optional[Path], *, overwrite: bool,
                  option: str) -> None:
    """Refuse, before any stage process starts, to replace a file that is not this command's own
    output (a timeline JSON or a Gantt PNG it stamped; in an --out directory, a gantt.png beside the
    command's timeline.json), or its own without --overwrite."""
    from gpipe_repro.report.output_guard import owned_json, written_by

    def own(path: Path) -> bool:
        if path == timeline:
            return owned_json(path, COMMAND, _is_timeline)
        return written_by(path) == COMMAND or (
            option == "--out" and timeline is not None and timeline.exists()
            and owned_json(timeline, COMMAND, _is_timeline))

    check_out_files(option, [p for p in (timeline, gantt) if p is not None], COMMAND,
                    overwrite=overwrite, own=own)


def train_rank(options: dict[str, Any]) -> dict[str, Any]:
    """One stage process: build, train `steps` steps, return losses, step times and the timeline."""
    import torch
    from torch import nn

    from gpipe_repro import GPipe
    from gpipe_repro.distributed.faults import InjectedFault
    from gpipe_repro.distributed.runtime import DistributedRuntime
    from gpipe_repro.models.mlp import synthetic_mlp
    from gpipe_repro.train.console import NoProgress

    k, blocks = options["partitions"], options["blocks"]
    layers = synthetic_mlp(options["width"], blocks)
    balance = [blocks // k + (1 if s < blocks % k else 0) for s in range(k)]
    if options["fail_mode"]:
        at = sum(balance[:options["fail_rank"]])
        layers.insert(at, InjectedFault(options["fail_mode"], options["fail_call"]))
        balance[options["fail_rank"]] += 1
    pipe = GPipe(layers, partitions=k, micro_batches=options["micro_batches"], balance=balance,
                 checkpoint=options["checkpoint"], recompute_ahead=options["recompute_ahead"],
                 loss_fn=nn.CrossEntropyLoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
                 runtime="distributed")
    runtime = pipe.runtime
    assert isinstance(runtime, DistributedRuntime)
    pipe.record_timeline = True
    g = torch.Generator().manual_seed(1)
    x = torch.randn(options["batch"], options["width"], generator=g)
    y = torch.randint(0, 10, (options["batch"],), generator=g)
    losses, times = [], []
    progress = NoProgress(quiet=pipe.rank != 0)     # a plain line every 30 s from rank 0
    progress.add_task(total=options["steps"])
    for step in range(options["steps"]):
        losses.append(pipe.train_step(x, y))
        times.append(runtime.last_step_time)
        progress.update(completed=step + 1, loss=losses[-1])
    out = {"rank": pipe.rank, "losses": losses, "step_times": times,
           "timeline": pipe.last_timeline if pipe.rank == 0 else None}
    if options["launcher"] == "torchrun" and pipe.rank == 0:
        report(out, options)
    return out


def report(rank0: dict[str, Any], options: dict[str, Any]) -> None:
    """Print the run and write the requested files (rank 0, after success)."""
    import statistics

    from gpipe_repro.report.gantt import render_gantt
    from gpipe_repro.report.records import write_json

    times = rank0["step_times"]
    print(f"K={options['partitions']} M={options['micro_batches']} checkpoint={options['checkpoint']} "
          f"recompute_ahead={options['recompute_ahead']}: losses "
          + " ".join(f"{v:.4f}" for v in rank0["losses"]))
    print("step times (s): " + " ".join(f"{t:.4f}" for t in times)
          + (f"; median after the first: {statistics.median(times[1:]):.4f}" if len(times) > 1 else ""))
    timeline = rank0["timeline"]
    if options.get("fresh_dir"):      # under torchrun: the fresh runs/pipeline-N, claimed now
        from gpipe_repro.train.run_dir import fresh_run_dir
        directory = fresh_run_dir("pipeline")
        options = {**options, "timeline": str(directory / "timeline.json"),
                   "gantt": str(directory / "gantt.png")}
    print("breakdown of the last step: " + ", ".join(f"{k} {v:.1%}" for k, v in
                                                     timeline.breakdown().items()))
    if options["timeline"]:
        write_json(options["timeline"], {"method": "measured", "options": options,
                                         "timeline": timeline.to_json(), "written_by": COMMAND})
        print(f"timeline: {options['timeline']}")
    if options["gantt"]:
        render_gantt(timeline, options["gantt"],
                     title=f"measured: K={options['partitions']} M={options['micro_batches']} "
                           f"checkpoint={options['checkpoint']}", written_by=COMMAND)
        print(f"Gantt chart: {options['gantt']}")


def register(app: typer.Typer) -> None:
    @app.command("pipeline")
    def pipeline(
        k: int = typer.Option(2, "--k", "-k", help=HELP["k"] + "; one stage process each"),
        m: int = typer.Option(8, "--m", "-m", help=HELP["m"]),
        checkpoint: str = typer.Option("never", help="re-materialization: always | except_last | never"),
        recompute_ahead: bool = typer.Option(False, help="recompute before waiting for the gradient"),
        batch_size: int = typer.Option(512, "--batch-size", help=HELP["batch_size"]),
        width: int = typer.Option(512, help="width of each Linear layer"),
        blocks: int = typer.Option(8, help="number of Linear+ReLU layers"),
        steps: int = typer.Option(5, help="training steps"),
        launcher: str = typer.Option("local", help="local (spawn K processes here) | torchrun"),
        timeout: float = typer.Option(30.0, help="seconds before a silent peer counts as failed"),
        threads: int = typer.Option(1, help="intra-op threads per stage process"),
        out: Optional[Path] = typer.Option(None, help="directory for timeline.json and gantt.png "
                                           "(default: a fresh runs/pipeline-N)"),
        timeline: Optional[Path] = typer.Option(None, help="write the last step's timeline (JSON) here "
                                                "(then only the files named are written)"),
        gantt: Optional[Path] = typer.Option(None, help="write the last step's Gantt chart (PNG) here"),
        overwrite: bool = typer.Option(False, "--overwrite", help="replace this command's earlier "
                                       "timeline / Gantt chart there (any other file is refused)"),
        fail_mode: Optional[str] = typer.Option(None, help="inject a failure: raise | kill | exit | hang"),
        fail_rank: Optional[int] = typer.Option(None, help="rank that fails (with --fail-mode; "
                                                "default 0)"),
        fail_call: Optional[int] = typer.Option(None, help="fail at this call of the faulty layer "
                                                "(1-based; with --fail-mode; default 1)"),
    ) -> None:
        """Train a synthetic MLP with one process per stage; print losses, step times, breakdown, and
        write the last step's timeline and Gantt chart."""
        from gpipe_repro.distributed.faults import FAULT_MODES
        from gpipe_repro.train.run_dir import fresh_run_dir

        partitions, micro_batches, batch = k, m, batch_size
        positive("--k", partitions, "stage processes")
        positive("--m", micro_batches, "micro-batches")
        positive("--steps", steps, "training steps")
        positive("--blocks", blocks)
        positive("--width", width)
        positive("--threads", threads, "intra-op threads per stage process")
        positive_number("--timeout", timeout, "seconds")
        from gpipe_repro.engine.schedule import CHECKPOINT_MODES
        if checkpoint not in CHECKPOINT_MODES:
            raise typer.BadParameter(f"--checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got "
                                     f"{checkpoint!r}")
        if batch < micro_batches:
            raise typer.BadParameter(f"--batch-size {batch} < --m {micro_batches}: every micro-batch needs "
                                     "an example")
        if launcher not in LAUNCHERS:
            raise typer.BadParameter(f"--launcher must be one of {LAUNCHERS}")
        if fail_mode is not None and fail_mode not in FAULT_MODES:
            raise typer.BadParameter(f"--fail-mode must be one of {FAULT_MODES}")
        if fail_mode is None and (fail_rank is not None or fail_call is not None):
            raise typer.BadParameter("--fail-rank and --fail-call say where --fail-mode injects its "
                                     f"failure: add --fail-mode ({' | '.join(FAULT_MODES)})")
        fail_rank = 0 if fail_rank is None else fail_rank
        fail_call = 1 if fail_call is None else fail_call
        positive("--fail-call", fail_call, "calls (1 is the first)")
        if launcher == "torchrun" and "RANK" not in os.environ:
            raise typer.BadParameter(
                f"--launcher torchrun: start the job with torchrun, e.g. `torchrun --nproc-per-node "
                f"{partitions} -- $(which gpipe-repro) pipeline --launcher torchrun --k {partitions}`; "
                "or use --launcher local (the default)")
        if not 0 <= fail_rank < partitions:
            raise typer.BadParameter(f"--fail-rank must be in 0..{partitions - 1} (one of the "
                                     f"--k {partitions} stages)")
        if blocks < partitions:
            raise typer.BadParameter(f"--blocks must be >= --k ({partitions}): each stage needs a layer")
        if timeline is None and gantt is None:        # neither file named: both, in one directory
            if out is not None and out.exists() and not out.is_dir():
                raise typer.BadParameter(f"--out {out} is a file: give a new or empty directory")
            if out is not None and out.is_dir() and any(
                    p.name not in ("timeline.json", "gantt.png") for p in out.iterdir()):
                raise typer.BadParameter(f"--out {out} holds other files; give an empty or new directory")
            if out is not None:
                check_outputs(out / "timeline.json", out / "gantt.png", overwrite=overwrite,
                              option="--out")
            # under torchrun every rank runs this command: rank 0 claims a fresh runs/pipeline-N
            # when it writes (report), so no rank leaves an empty one behind
            fresh = out is None and launcher == "torchrun"
            directory = out if out is not None else None if fresh else fresh_run_dir("pipeline")
            timeline, gantt = ((None, None) if directory is None else
                               (directory / "timeline.json", directory / "gantt.png"))
        else:
            check_outputs(timeline, gantt, overwrite=overwrite,
                          option="/".join(f for f, v in (("--timeline", timeline), ("--gantt", gantt))
                                          if v is not None))
        options = {"partitions": partitions, "micro_batches": micro_batches, "checkpoint": checkpoint,
                   "recompute_ahead": recompute_ahead, "batch": batch, "width": width,
                   "blocks": blocks, "steps": steps, "launcher": launcher, "fail_mode": fail_mode,
                   "fail_rank": fail_rank, "fail_call": fail_call,
                   "fresh_dir": timeline is None and gantt is None,
                   "timeline": str(timeline) if timeline else None, "gantt": str(gantt) if gantt else None}
        from gpipe_repro.train.run_dir import release_unused_claims
        if launcher == "torchrun":
            from gpipe_repro.distributed.launch_env import THREADS_ENV, TIMEOUT_ENV
            from gpipe_repro.distributed.watchdog import stage_main
            os.environ.setdefault(TIMEOUT_ENV, str(timeout))
            os.environ.setdefault(THREADS_ENV, str(threads))
            stage_main(train_rank, options)
            return
        from gpipe_repro.commands.run import interrupted_by
        from gpipe_repro.distributed.launcher import JobFailed, launch_local
        from gpipe_repro.report.host import usable_cores
        if partitions * threads > usable_cores():
            print(f"note: {partitions} stage processes x {threads} thread(s) on {usable_cores()} usable "
                  "core(s) time-share them: the step times and the breakdown measure the operating "
                  "system's scheduling as much as the pipeline", flush=True)
        try:
            results = launch_local(train_rank, partitions, options, timeout=timeout, threads=threads)
        except JobFailed as e:
            interrupted_by(e)            # a Ctrl-C: one line, exit code 130
            raise typer.Exit(1) from e   # the launcher already printed the failing rank and its cause
        finally:
            release_unused_claims()      # a failed or interrupted run leaves no empty runs/pipeline-N
        report(results[0], options)
