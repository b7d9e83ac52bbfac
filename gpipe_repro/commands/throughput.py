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

from gpipe_repro.commands.options import EXPERIMENTS, HELP, check_out_files, int_list, one_of, positive


def register(app: typer.Typer) -> None:
    @app.command("throughput-table", rich_help_panel=EXPERIMENTS)
    def throughput_table(
            ctx: typer.Context,
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
            cuts_from: Optional[Path] = typer.Option(
                None, "--cuts-from", help="an earlier throughput_table.json whose cuts are kept where "
                "the new calibration cannot tell them from its best (default: the table this run "
                "replaces in --out)"),
            fresh_cuts: bool = typer.Option(False, "--fresh-cuts", help="choose every cut from the "
                                            "new costs alone"),
            time_limit: Optional[float] = typer.Option(
                None, "--time-limit", min=60.0, help="seconds the whole table may take: the measured "
                "rounds share what calibrating left, ending sooner with wider intervals (make results "
                "gives its part's limit)"),
    ) -> None:
        """The paper's Tables 2 and 3: K x M normalized throughput, simulated and measured."""
        from gpipe_repro.engine.partition import OBJECTIVES
        from gpipe_repro.report.output_guard import OutputRefused
        from gpipe_repro.report.records import results_root
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
                                        recompute_ahead=recompute_ahead, method=method, measure=measure,
                                        time_limit_s=time_limit)
        try:
            table.main(settings, out if out is not None else results_root() / "throughput",
                       overwrite=overwrite, record=record, wandb=wandb,
                       command={"prog": "gpipe-repro throughput-table", "record": record,
                                "argv": [a for a in _given(ctx) if a != "--record"]},
                       cuts_from=cuts_from, fresh_cuts=fresh_cuts)
        except (OutputRefused, FileExistsError) as e:
            raise typer.BadParameter(str(e), param_hint="--out") from None
        except table.CutsSourceError as e:
            raise typer.BadParameter(str(e), param_hint="--cuts-from") from None

    @app.command("validate-sim", rich_help_panel=EXPERIMENTS)
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
            steps: Optional[int] = typer.Option(None, "--steps", help="measured steps per configuration "
                                                "and round"),
            rounds: Optional[int] = typer.Option(None, "--rounds", help="rounds: every configuration "
                                                 "measured once per round, the rounds interleaved "
                                                 "(default 3)"),
            budget: Optional[float] = typer.Option(None, "--budget", help="seconds the rounds end "
                                                   "within: a round past the second starts only where "
                                                   "it fits, and the second ends at the first "
                                                   "configuration that would not (default: none)"),
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
        from gpipe_repro.report.output_guard import OutputRefused
        from gpipe_repro.repro import validate_simulator
        try:
            given: dict[str, Any] = {"models": _names(models), "ms": int_list("--ms", ms),
                                     "schedules": _names(schedules), "steps": steps, "rounds": rounds}
            validate_simulator.main(**{k: v for k, v in given.items() if v is not None},
                                    ks=int_list("--ks", ks), out=out, overwrite=overwrite, record=record,
                                    render_only=render_only, budget=budget)
        except (ValueError, OutputRefused) as e:
            raise typer.BadParameter(str(e)) from None

    @app.command("validate-unseen", rich_help_panel=EXPERIMENTS)
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
                                      "(and round; their median and its interval)"),
            rounds: int = typer.Option(1, "--rounds", min=1, help="interleaved rounds: every model "
                                       "calibrated afresh in each, every configuration measured once "
                                       "in each, against that round's costs (1: each configuration as "
                                       "`throughput --validate --rounds 1` runs it, in one burst)"),
            repeats: int = typer.Option(20, "--repeats", min=1, help="timings a layer and action per "
                                        "calibration of a round (with --rounds > 1)"),
            budget: Optional[float] = typer.Option(None, "--budget", min=1, help="seconds the rounds end "
                                                   "within (with --rounds > 1): a round past the "
                                                   "second starts only where it fits, and the second "
                                                   "ends at the first configuration that would not "
                                                   "(default: none)"),
            out: Optional[str] = typer.Option(None, "--out", help="output directory (default: "
                                              "results/throughput/)"),
            in_situ: bool = typer.Option(True, "--in-situ/--no-in-situ", help="also correct each "
                                         "configuration from a short run of its own and report both "
                                         "errors"),
            in_situ_m: int = typer.Option(1, "--in-situ-m", min=1, help="micro-batches per step of the "
                                          "in-situ runs"),
            overwrite: bool = typer.Option(False, "--overwrite", help="replace an earlier result of "
                                           "this command in --out (never a file it did not write)"),
            record: bool = typer.Option(False, "--record", help="may replace the results of record "
                                        "(what `make validate-unseen` passes)"),
    ) -> None:
        """The simulator against real runs (K=2) of models it was never tuned on."""
        from gpipe_repro.repro import validate_unseen as unseen
        given = _given(ctx)
        options: dict[str, Any] = {"ms": int_list("--ms", ms), "checkpoints": _names(checkpoints)}
        if models is not None:
            options["models"] = _names(models)
        try:
            unseen.main(batch=batch_size, steps=steps, rounds=rounds, repeats=repeats, out=out,
                        budget=budget, overwrite=overwrite, record=record,
                        in_situ=in_situ, in_situ_m=in_situ_m,
                        **options,
                        command=" ".join(["gpipe-repro validate-unseen", *[a for a in given
                                                                          if a != "--record"]])
                        if [a for a in given if a != "--record"] else "make validate-unseen")
        except SystemExit as e:
            raise typer.BadParameter(str(e)) from None

    @app.command("throughput")
    def throughput(
            model: Optional[str] = typer.Option(None, "--model", help="your model: module:factory (returns "
                                                "the layers), hf:<family> or a Hugging Face config.json; "
                                                "with --replicas: transformer | amoebanet (the paper's)"),
            option: list[str] = typer.Option([], "--option", help="KEY=VALUE: a keyword argument of the "
                                              "factory (repeat it for several)"),
            kind: Optional[str] = typer.Option(None, "--kind", help="features: float inputs, class "
                                               "targets (default); image; tokens (hf: tokens)"),
            input_shape: Optional[str] = typer.Option(None, "--input-shape", help="one example's shape, "
                                                      "e.g. 784 or 3,32,32 (tokens: sequence length)"),
            classes: Optional[int] = typer.Option(None, "--classes", help="classes, or the vocabulary "
                                                  "size for tokens (default 10; hf: the model's)"),
            k: Optional[int] = typer.Option(None, "--k", "-k", help=HELP["k"] + " (with --replicas: "
                                            "default 8)"),
            m: Optional[int] = typer.Option(None, "--m", "-m", help=HELP["m"] + " (with --replicas: per "
                                            "replica, default 32)"),
            microbatch: Optional[int] = typer.Option(None, "--microbatch", help="examples per micro-batch "
                                                     "(default 8; with --replicas 1)"),
            checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="re-materialization: "
                                                     "always | except_last | never (default except_last; "
                                                     "with --replicas always)"),
            recompute_ahead: bool = typer.Option(False, "--recompute-ahead",
                                                 help="recompute before waiting for the gradient"),
            objective: str = typer.Option("bottleneck", "--objective", help="partitioner objective"),
            link: Optional[str] = typer.Option(None, "--link", help="link model (default gloo-loopback; "
                                               "with --replicas nvlink, the pipeline's boundary link)"),
            method: str = typer.Option("time", "--method", help="costs: time (calibrated) | flops"),
            repeats: int = typer.Option(20, "--repeats", help="timings per layer action"),
            validate: Optional[bool] = typer.Option(None, "--validate/--no-validate", help="also run on K "
                                                    "stage processes (default: where K fits the host)"),
            rounds: int = typer.Option(3, "--rounds", help="with --validate: measured rounds of "
                                       "--steps steps, the costs calibrated afresh before each (with "
                                       "more than one), each round's steps against its own costs; "
                                       "the simulated step from their median"),
            steps: int = typer.Option(4, "--steps", help="with --validate: measured steps per round"),
            in_situ: bool = typer.Option(False, "--in-situ", help="also correct the calibrated costs from "
                                         "a short run of the cut at one micro-batch per step on K stage "
                                         "processes (a CPU host with K cores), a run apart from "
                                         "--validate's; prints both figures and the factors"),
            in_situ_steps: int = typer.Option(3, "--in-situ-steps", help="steps of the --in-situ run "
                                              "(after one warm-up)"),
            in_situ_m: int = typer.Option(1, "--in-situ-m", help="micro-batches per step of the --in-situ "
                                          "run (of --microbatch examples each)"),
            out: Optional[Path] = typer.Option(None, "--out", help="also write the result here (JSON)"),
            overwrite: bool = typer.Option(False, "--overwrite", help="replace an earlier result of this "
                                           "command at --out (any other existing file is refused)"),
            replicas: Optional[int] = typer.Option(None, "--replicas", help="R: data-parallel replicas of "
                                                   "a K-stage pipeline of the paper's models (simulated "
                                                   "samples/s, the all-reduce included)"),
            device: Optional[str] = typer.Option(None, "--device", help="with --replicas: the device "
                                                 "model, p100 (default) | tpu-v3-core"),
            devices_per_host: Optional[int] = typer.Option(None, "--devices-per-host", help="with "
                                                           "--replicas: devices per host (a pipeline "
                                                           "stays inside one; default 8)"),
            algorithm: Optional[str] = typer.Option(None, "--algorithm", help="with --replicas: "
                                                    "all-reduce, ring (default) | tree"),
    ) -> None:
        """Simulate your own model (or a Hugging Face causal LM) as a K-stage pipeline: the cut, step
        time and speedup, and a real run where K fits the host; with --replicas R, R data-parallel
        replicas of the paper's models: samples/s and the time breakdown."""
        for flag, value in (("--k", k), ("--m", m), ("--microbatch", microbatch), ("--repeats", repeats),
                            ("--classes", classes), ("--replicas", replicas),
                            ("--devices-per-host", devices_per_host), ("--in-situ-steps", in_situ_steps),
                            ("--in-situ-m", in_situ_m), ("--rounds", rounds), ("--steps", steps)):
            positive(flag, value)
        if checkpoint is not None:
            one_of("--checkpoint", checkpoint, ("always", "except_last", "never"))
        if replicas is None:
            given = [flag for flag, value in (("--device", device), ("--devices-per-host", devices_per_host),
                                              ("--algorithm", algorithm)) if value is not None]
            if given:
                raise typer.BadParameter(f"{', '.join(given)}: options of --replicas R (the paper's models "
                                         "on simulated devices); your own model is timed on this host: "
                                         "leave them out, or add --replicas")
        if replicas is not None:
            one_of("--algorithm", algorithm or "ring", ("ring", "tree"))
            _replicas(model=model or "transformer", k=k or 8, replicas=replicas, m=m or 32,
                      microbatch=microbatch or 1, device=device or "p100", link=link or "nvlink",
                      devices_per_host=devices_per_host or 8, algorithm=algorithm or "ring",
                      checkpoint=checkpoint or "always", out=out, overwrite=overwrite,
                      own=dict(option=option, kind=kind, input_shape=input_shape, classes=classes,
                               validate=validate, in_situ=in_situ or None))
            return
        if model is not None and input_shape is None:
            input_shape = _default_input_shape(model)
        if model is None or input_shape is None or k is None or m is None:
            missing = [flag for flag, value in (("--model", model), ("--input-shape", input_shape),
                                                ("--k", k), ("--m", m)) if value is None]
            raise typer.BadParameter(f"missing {', '.join(missing)}: give --model, --input-shape, --k "
                                     "and --m (your model), or --replicas R (the paper's models)")
        from gpipe_repro.engine.partition import OBJECTIVES
        from gpipe_repro.sim.links import LINK_NAMES
        one_of("--objective", objective, OBJECTIVES)
        one_of("--method", method, ("time", "flops"))
        one_of("--link", link or "gloo-loopback", LINK_NAMES)
        shape = int_list("--input-shape", input_shape, "784 or 3,32,32") or []
        if min(shape, default=0) < 1:
            raise typer.BadParameter(f"--input-shape takes sizes >= 1 (one example's shape, e.g. 784 or "
                                     f"3,32,32), got {input_shape}")
        if in_situ:
            _check_in_situ(k)
        workload = _own_workload(model, _key_values(option), kind, shape, classes)
        from gpipe_repro.repro import simulate_model
        if out is not None:
            check_out_files("--out", [out], simulate_model.COMMAND, overwrite=overwrite)
        problem = simulate_model.preflight(workload, microbatch or 8, options=dict(workload.options))
        if problem is not None:
            raise typer.BadParameter(problem)
        options: dict[str, Any] = dict(
            k=k, m=m, microbatch=microbatch or 8, checkpoint=checkpoint or "except_last",
            objective=objective, link=link or "gloo-loopback", validate=validate, in_situ=in_situ,
            in_situ_steps=in_situ_steps, in_situ_microbatches=in_situ_m)
        from gpipe_repro.sim.own_model import check_options
        try:   # a setting to change (exit code 2), before the calibration's work
            check_options(workload, schedule="gpipe", device="cpu", **options)
        except ValueError as e:    # the API's argument names, as this command's options
            text = str(e).replace("validate=False", "--no-validate").replace("use k <=", "use --k <=")
            raise typer.BadParameter(text) from None
        from gpipe_repro.distributed.launcher import JobFailed
        try:
            simulate_model.main(workload, out=out, recompute_ahead=recompute_ahead, method=method,
                                repeats=repeats, rounds=rounds, steps=steps, **options)
        except ValueError as e:
            raise typer.Exit(_error(str(e))) from None
        except JobFailed as e:     # a stage process of the measured run failed, or was stopped
            raise typer.Exit(_error(f"the measured run on stage processes failed: {e}")) from None



def _check_in_situ(k: int) -> None:
    """Refuse --in-situ where its run cannot happen: K stage processes need K usable cores."""
    from gpipe_repro.report.host import usable_cores
    cores = usable_cores()
    if k > cores:
        raise typer.BadParameter(f"--in-situ runs K={k} stage processes on one core each, but this host "
                                 f"has {cores} usable core(s): use --k {cores} or less, or drop --in-situ")


def _given(ctx: typer.Context) -> list[str]:
    """The options given on the command line, as they would be typed (a flag alone for a switch)."""
    import shlex
    given = []
    for p in ctx.command.params:
        if p.name and getattr(ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE":
            value = ctx.params[p.name]
            flag = p.opts[0] if value is not False else (p.secondary_opts or p.opts)[0]
            given.append(flag if isinstance(value, bool) else f"{flag} {shlex.quote(str(value))}")
    return given


def _key_values(items: list[str]) -> dict[str, Any]:
    """``["width=1024", "name=x"]`` -> {"width": 1024, "name": "x"} (values as Python literals where
    they are one); anything without a key and `=` is a usage error."""
    import ast
    values: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--option takes KEY=VALUE, got {item!r}")
        try:
            values[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            values[key] = text
    return values


def _default_input_shape(model: str) -> Optional[str]:
    """An example's shape where the model says it: a Hugging Face causal LM takes a sequence of token
    ids, :data:`HF_SEQ_LEN` long unless --input-shape says otherwise (said on the console)."""
    from gpipe_repro.commands._hf_models import is_hf_model
    if not is_hf_model(model):
        return None
    typer.echo(f"{model}: examples of {HF_SEQ_LEN} token ids (--input-shape N for another length)", err=True)
    return str(HF_SEQ_LEN)


HF_SEQ_LEN = 128


def _own_workload(model: str, options: dict[str, Any], kind: Optional[str], shape: list[int],
                  classes: Optional[int]) -> Any:
    """The workload `--model` names (a module:factory, or a Hugging Face model through its factory),
    checked before any work."""
    from gpipe_repro.commands._hf_models import is_hf_model, throughput_model
    from gpipe_repro.models.workload import KINDS, Workload
    name = model                 # what the user named, in the header (the factory is internal)
    if is_hf_model(model):
        try:
            model, options, vocabulary = throughput_model(model, options)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--model") from None
        kind, classes = kind or "tokens", classes or vocabulary
    one_of("--kind", kind or "features", KINDS)
    try:
        return Workload.create(name, model, kind or "features", shape, classes or 10, **options)
    except ValueError as e:
        own = ("" if ":" in model or "/" in model else
               f"; your own model is named as module:function, e.g. --model {model}:make_model")
        raise typer.BadParameter(f"{e}{own}") from None


def _replicas(*, own: dict[str, Any], out: Optional[Path], overwrite: bool, **job: Any) -> None:
    """`throughput --replicas R`: the K x R simulation of the paper's models, printed (and written)."""
    given = [f"--{name.replace('_', '-')}" for name, value in own.items() if value not in (None, [])]
    if given:
        raise typer.BadParameter(f"{', '.join(given)}: your own model's options; with --replicas the "
                                 "model is one of the paper's (--model transformer | amoebanet)")
    from gpipe_repro.repro.replicas_throughput import COMMAND, format_job, simulate_job
    if out is not None:
        check_out_files("--out", [out], COMMAND, overwrite=overwrite)
    try:
        result = simulate_job(**job)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    print(format_job(result))
    if out is not None:
        from gpipe_repro.report.records import write_json
        write_json(out, {**result, "written_by": COMMAND})
        print(f"wrote {out}")


def _error(message: str) -> int:
    """Print `message` as the command's error; the exit code of a failed simulation (1)."""
    typer.echo(f"error: {message}", err=True)
    return 1


def _names(text: str | None) -> list[str] | None:
    """"a,b" -> ["a", "b"] (None for None)."""
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]
