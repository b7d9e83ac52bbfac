"""`gpipe-repro throughput-table`, `gpipe-repro validate-sim` and `gpipe-repro throughput`: the paper's
Tables 2/3, the simulator's check against real stage processes, and the simulation of your own model.

    gpipe-repro throughput-table --record            # `make throughput-table`
    gpipe-repro throughput-table --paper-size --device cuda --out /tmp/t
    gpipe-repro validate-sim --record                # `make validate-sim`
    gpipe-repro throughput --model pkg.mod:factory --input-shape 784 --k 2 --m 8   # your own model
    gpipe-repro throughput --model hf:llama --option layers=4 --option hidden=128 --input-shape 64 \\
        --k 2 --m 4                                  # a Hugging Face causal LM (or a config.json)

The make targets run these same commands (experiments/throughput_table.py, validate_simulator.py).
The results of record (the checkout's results/) are replaced only with --record; write elsewhere
with --out DIR or GPIPE_REPRO_RESULTS=DIR. Their own earlier output elsewhere is replaced only with
--overwrite, and a file they did not write, never.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from gpipe_repro.commands.options import HELP, int_list, one_of, positive

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def register(app: typer.Typer) -> None:
    @app.command("throughput-table")
    def throughput_table(
            paper_size: bool = typer.Option(False, "--paper-size", help="the paper's exact models "
                                            "(AmoebaNet-D (18, 256), Transformer-48 d 2048): use on a GPU "
                                            "host with --device cuda"),
            device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
            link: Optional[str] = typer.Option(None, "--link", help="link model of the simulation "
                                               "(default: gloo-loopback on cpu, nvlink on cuda)"),
            policy: str = typer.Option("micro", "--policy", help="micro: fixed micro-batch, N = M x b; "
                                       "mini: fixed mini-batch N (--minibatch)"),
            minibatch: int = typer.Option(64, "--minibatch", help="N of the mini policy"),
            objective: str = typer.Option("bottleneck", "--objective", help="partitioner objective"),
            checkpoint: str = typer.Option("always", "--checkpoint",
                                           help="re-materialization: always | except_last | never"),
            recompute_ahead: bool = typer.Option(False, "--recompute-ahead",
                                                 help="recompute before waiting for the gradient"),
            method: str = typer.Option("time", "--method", help="costs: time (calibrated) | flops"),
            measure: bool = typer.Option(True, "--measure/--no-measure",
                                         help="also measure on real stage processes where K fits"),
            wandb: bool = typer.Option(True, "--wandb/--no-wandb", help="log the sweep to W&B"),
            out: Optional[Path] = typer.Option(None, "--out", help="output directory (default: "
                                               "results/throughput, under $GPIPE_REPRO_RESULTS when set)"),
            overwrite: bool = typer.Option(False, "--overwrite",
                                           help="replace an earlier throughput table in --out"),
            record: bool = typer.Option(False, "--record", help="may replace the results of record "
                                        "(what `make throughput-table` does)"),
    ) -> None:
        """The paper's Tables 2 and 3: K x M normalized throughput, simulated and measured."""
        import sys

        from gpipe_repro.engine.partition import OBJECTIVES
        from gpipe_repro.report.records import OutputRefused, results_root
        from gpipe_repro.repro import throughput_table as table
        from gpipe_repro.repro.throughput import POLICIES
        from gpipe_repro.sim.links import LINK_NAMES
        for flag, value, choices in (("--device", device, ("cpu", "cuda")), ("--policy", policy, POLICIES),
                                     ("--objective", objective, OBJECTIVES), ("--method", method,
                                                                              ("time", "flops")),
                                     ("--checkpoint", checkpoint, ("always", "except_last", "never"))):
            one_of(flag, value, choices)
        if link is not None:
            one_of("--link", link, LINK_NAMES)
        positive("--minibatch", minibatch)
        settings = table.sweep_settings(paper_size=paper_size, device=device, link=link, policy=policy,
                                        minibatch=minibatch, objective=objective, checkpoint=checkpoint,
                                        recompute_ahead=recompute_ahead, method=method, measure=measure)
        try:
            table.main(settings, out if out is not None else results_root() / "throughput",
                       overwrite=overwrite, record=record, wandb=wandb,
                       command={"prog": "gpipe-repro throughput-table", "argv": sys.argv[1:]})
        except (OutputRefused, FileExistsError) as e:
            raise typer.BadParameter(str(e), param_hint="--out") from None

    @app.command("validate-sim")
    def validate_sim(
            models: Optional[str] = typer.Option(None, "--models", help="models to validate, "
                                                 "comma-separated (default: both of the table)"),
            ms: Optional[str] = typer.Option(None, "--ms", help=HELP["m"] + " to validate, e.g. 1,4 "
                                             "(default: 1,2,4,8,16)"),
            ks: Optional[str] = typer.Option(None, "--ks", help=HELP["k"] + " to validate (default: "
                                             "every K in 2, 4, 8 up to the usable cores)"),
            schedules: Optional[str] = typer.Option(None, "--schedules", help="schedules to validate, "
                                                    "comma-separated (default: every one the runtime "
                                                    "runs)"),
            steps: Optional[int] = typer.Option(None, "--steps", help="measured steps per configuration"),
            out: Optional[Path] = typer.Option(None, "--out", help="output directory (default: "
                                               "results/throughput, under $GPIPE_REPRO_RESULTS when set)"),
            overwrite: bool = typer.Option(False, "--overwrite", help="replace an earlier validation (and "
                                           "the throughput_table.md it refreshes)"),
            render_only: bool = typer.Option(False, "--render-only", help="measure nothing: rewrite "
                                             "validation.md and throughput_table.md from the JSON files "
                                             "already in --out"),
            record: bool = typer.Option(False, "--record", help="may replace the results of record "
                                        "(what `make validate-sim` does)"),
    ) -> None:
        """Simulated vs measured throughput on real stage processes (K <= usable cores)."""
        from gpipe_repro.report.records import OutputRefused
        from gpipe_repro.repro import validate_simulator
        try:
            given: dict[str, Any] = {"models": _names(models), "ms": int_list("--ms", ms),
                                     "schedules": _names(schedules), "steps": steps}
            validate_simulator.main(**{k: v for k, v in given.items() if v is not None},
                                    ks=int_list("--ks", ks), out=out, overwrite=overwrite, record=record,
                                    render_only=render_only)
        except (ValueError, OutputRefused) as e:
            raise typer.BadParameter(str(e)) from None

    @app.command("validate-unseen")
    def validate_unseen(
            ctx: typer.Context,
            batch_size: int = typer.Option(256, "--batch-size", min=1, help="mini-batch of every "
                                           "configuration"),
            ms: str = typer.Option("1,2,4,8,16", "--ms", help=HELP["m"] + " to run, each dividing the "
                                   "batch, e.g. 1,4"),
            checkpoints: str = typer.Option("never,always", "--checkpoints",
                                            help="re-materialization modes to run, comma-separated"),
            models: Optional[str] = typer.Option(None, "--models", help="models to run, comma-separated "
                                                 "(default: every one)"),
            steps: int = typer.Option(8, "--steps", min=1, help="measured steps per configuration "
                                      "(their median and its interval)"),
            out: Optional[str] = typer.Option(None, "--out", help="output directory (default: "
                                              "results/throughput/)"),
    ) -> None:
        """The simulator against real runs (K=2) of models it was never tuned on."""
        import shlex

        from gpipe_repro.repro import validate_unseen as unseen
        given = [f"{p.opts[0]} {shlex.quote(str(ctx.params[p.name]))}" for p in ctx.command.params
                 if p.name and getattr(ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE"]
        options: dict[str, Any] = {"ms": int_list("--ms", ms), "checkpoints": _names(checkpoints)}
        if models is not None:
            options["models"] = _names(models)
        try:
            unseen.main(batch=batch_size, steps=steps, out=out, **options,
                        command=" ".join(["gpipe-repro validate-unseen", *given]) if given
                        else "make validate-unseen")
        except SystemExit as e:
            raise typer.BadParameter(str(e)) from None

    @app.command("throughput", context_settings=_PASS_THROUGH, add_help_option=False)
    def throughput(ctx: typer.Context) -> None:
        """Simulate your own model (--model module:factory --input-shape ... --k K --m M; or a Hugging
        Face causal LM: --model hf:llama --option layers=4 ..., or --model path/to/config.json, with
        --input-shape SEQ_LEN): step time, speedup, and a real run where K fits the host; with
        --replicas R: R data-parallel replicas of a K-stage pipeline of a registry model (--model
        transformer-lm --k 8 --replicas 128 --m 32): samples/s and the time breakdown, all-reduce
        included (--help, --replicas 1 --help)."""
        args = list(ctx.args)
        # One command, two simulations, chosen by an explicit table on whether --replicas is given.
        replicas = any(a == "--replicas" or a.startswith("--replicas=") for a in args)
        if replicas:
            from gpipe_repro.repro.replicas_throughput import main
        else:
            from gpipe_repro.commands._hf_models import throughput_args
            from gpipe_repro.commands.run import fail
            from gpipe_repro.repro.simulate_model import main
            try:
                args = throughput_args(args)     # --model hf:<family> or a config.json: its factory
            except ValueError as e:
                fail(str(e))
        main(args, prog="gpipe-repro throughput" + (" --replicas" if replicas else ""))


def _names(text: str | None) -> list[str] | None:
    """"a,b" -> ["a", "b"] (None for None)."""
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]
