"""`gpipe-repro throughput-table` and `gpipe-repro validate-sim`: the paper's Tables 2/3 and the
simulator's check against real stage processes.

    gpipe-repro throughput-table                     # same as `make throughput-table`
    gpipe-repro throughput-table --paper-size --device cuda
    gpipe-repro validate-sim                         # same as `make validate-sim`
    gpipe-repro throughput --model pkg.mod:factory --input-shape 784 --k 2 --m 8   # your own model
    gpipe-repro throughput --model hf:llama --option layers=4 --option hidden=128 --input-shape 64 \\
        --k 2 --m 4                                  # a Hugging Face causal LM (or a config.json)

Both pass their options through to the experiment modules (`--help` there lists them), so the
command line and the Makefile targets can never drift apart. One difference: these commands never
replace the results of record (the checkout's results/; only `make throughput-table` / `make
validate-sim` do): write elsewhere with --out DIR or GPIPE_REPRO_RESULTS=DIR. Their own earlier
output elsewhere is replaced only with --overwrite, and a file they did not write, never.
"""
from __future__ import annotations

import typer

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def register(app: typer.Typer) -> None:
    @app.command("throughput-table", context_settings=_PASS_THROUGH, add_help_option=False)
    def throughput_table(ctx: typer.Context) -> None:
        """The paper's Tables 2 and 3: K x M normalized throughput, simulated and measured
        (options: --paper-size, --device, --link, --policy, --objective, --no-measure; --help)."""
        from gpipe_repro.repro.throughput_table import main

        main(list(ctx.args), prog="gpipe-repro throughput-table")

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

    @app.command("validate-sim", context_settings=_PASS_THROUGH, add_help_option=False)
    def validate_sim(ctx: typer.Context) -> None:
        """Simulated vs measured throughput on real stage processes (K <= usable cores; --help)."""
        from gpipe_repro.repro.validate_simulator import main

        main(list(ctx.args), prog="gpipe-repro validate-sim")
