"""`gpipe-repro plan-replicas`: choose K, R and M for N devices; `gpipe-repro replicas-plan-table`
(`make replicas-plan-table`): that choice for Transformer-L and AmoebaNet-D on 8 to 2048 devices.
(`gpipe-repro throughput --replicas R`, the K x R simulation, is in commands/throughput.py, one
command with the own-model simulation.)
"""
from __future__ import annotations

from typing import Optional

import typer

from gpipe_repro.commands.memory import OPTIMIZER_HELP, check_optimizer, optimizer_state
from gpipe_repro.commands.options import EXPERIMENTS


def register(app: typer.Typer) -> None:
    """Add the command to the `gpipe-repro` app."""
    @app.command("plan-replicas", context_settings={"allow_extra_args": True,
                                                    "ignore_unknown_options": True})
    def plan_replicas_command(
            ctx: typer.Context,
            family: str = typer.Argument(
                ..., help="model family: transformer-lm, amoebanet-d, amoebanet-b or gpt2"),
            devices: int = typer.Option(8, "--devices", help="N: devices of the job (K x R = N)"),
            memory: float = typer.Option(16.0, "--memory", help="memory per device, GiB"),
            batch: Optional[int] = typer.Option(None, "--batch-size", help="mini-batch of ONE replica"),
            tflops: float = typer.Option(100.0, "--tflops", help="device compute rate, TFLOP/s"),
            link: str = typer.Option("nvlink", "--link", help="the pipeline's boundary link"),
            devices_per_host: int = typer.Option(
                8, "--devices-per-host", help="devices per host: whole pipelines share a host (K divides "
                     "it) or a pipeline spans whole hosts (K a multiple of it)"),
            algorithm: str = typer.Option("ring", "--algorithm", help="all-reduce: ring | tree"),
            optimizer: str = typer.Option("rmsprop", "--optimizer", help=OPTIMIZER_HELP),
            micro_batches: Optional[str] = typer.Option(None, "--m",
                                                        help="M candidates, e.g. 4,8,32"),
            top: int = typer.Option(6, "--top", help="candidates to show")) -> None:
        """Choose K, R = N / K, M and the partition for the best simulated samples/s within --memory
        GiB per device (extra options, e.g. --L 48, go to the model builder)."""
        from gpipe_repro.commands.models import parse_options
        from gpipe_repro.commands.options import int_list, one_of, positive, positive_number
        from gpipe_repro.memory.planner import GiB, MemoryPlanner
        from gpipe_repro.memory.profile import OPTIMIZERS
        from gpipe_repro.memory.replicas_plan import check_whole_hosts, plan_replicas
        from gpipe_repro.memory.workloads import workload
        from gpipe_repro.sim.links import LINK_NAMES, get_link

        # Every option checked before the model is built (a mistake is a usage error, exit code 2;
        # exit code 1 means "nothing fits").
        positive("--devices", devices, "devices of the job")
        positive("--devices-per-host", devices_per_host)
        try:
            check_whole_hosts(devices, devices_per_host, ("--devices", "--devices-per-host"))
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        positive("--batch-size", batch)
        positive("--top", top)
        positive_number("--memory", memory, "GiB")
        positive_number("--tflops", tflops, "TFLOP/s")
        one_of("--link", link, LINK_NAMES)
        one_of("--algorithm", algorithm, ("ring", "tree"))
        check_optimizer(optimizer)
        ms = int_list("--m", micro_batches) if micro_batches else None
        if ms is not None and min(ms) < 1:
            raise typer.BadParameter(f"--m candidates must be >= 1, got {micro_batches}")
        try:
            work = workload(family, batch, **parse_options(list(ctx.args)))
            inputs = work.planner_inputs()      # builds the model: a bad size (--L 0) fails here
        except (ValueError, TypeError) as e:
            raise typer.BadParameter(str(e)) from e
        from gpipe_repro.memory.profile import LayerNotTraceable
        planner = MemoryPlanner(*inputs, optimizer=OPTIMIZERS[optimizer][0], optimizer_foreach=True)
        left_out: dict[int, str] = {}
        try:
            cands = plan_replicas(planner, devices, memory * GiB, get_link(link), tflops * 1e12,
                                  micro_batches=ms, devices_per_host=devices_per_host,
                                  algorithm=algorithm, left_out=left_out)
        except LayerNotTraceable as e:
            raise typer.BadParameter(f"{family}: {e}") from None
        for why in left_out.values():
            print(f"not planned: {why}")
        print(f"{work.describe()}: {devices} devices of {memory:g} GiB, {tflops:g} TFLOP/s, "
              f"{devices_per_host} per host, {algorithm} all-reduce; replica mini-batch "
              f"{planner.batch}; {optimizer_state(optimizer)} (simulated; with R > 1 a peak holds the "
              "all-reduce's gradient buckets too, a flat copy of the stage's gradients that `fit` "
              "does not count)")
        print(f"{'K':>4} {'R':>5} {'M':>4} {'checkpoint':<12} {'fits':<4} {'peak GiB':>8} "
              f"{'samples/s':>10}  why")
        for c in cands[:top]:
            print(f"{c.partitions:>4} {c.replicas:>5} {c.pipeline.micro_batches:>4} "
                  f"{c.pipeline.checkpoint:<12} {'yes' if c.fits else 'no':<4} "
                  f"{c.peak_with_buckets / GiB:>8.2f} {c.throughput:>10.1f}  {c.why()}")
        best = cands[0] if cands and cands[0].fits else None
        if best is None:
            print(f"nothing fits on {devices} devices of {memory:g} GiB")
            raise typer.Exit(1)
        print(f"choose K={best.partitions} x R={best.replicas}, M={best.pipeline.micro_batches}, "
              f"checkpoint={best.pipeline.checkpoint}, balance={best.pipeline.balance}: "
              f"{best.throughput:.1f} samples/s; {best.why()}")

    @app.command("replicas-plan-table", rich_help_panel=EXPERIMENTS)
    def replicas_plan_table(
            memory: float = typer.Option(16.0, "--memory", help="memory per device, GiB"),
            tflops: float = typer.Option(100.0, "--tflops", help="device compute rate, TFLOP/s"),
            m: str = typer.Option("4,8,16,32", "--m", help="M candidates, e.g. 4,8,32"),
            devices: str = typer.Option("8,64,512,2048", "--devices", help="job sizes N, comma-separated"),
            overwrite: bool = typer.Option(False, "--overwrite", help="replace this command's earlier "
                                           "plan.{json,md} (never a file it did not write)"),
            record: bool = typer.Option(False, "--record", help="may replace the results of record "
                                        "(what `make replicas-plan-table` passes)"),
    ) -> None:
        """K x R x M for Transformer-L and AmoebaNet-D on 8 to 2048 devices (simulated), written to
        results/replicas/plan.{json,md}."""
        from gpipe_repro.commands.options import int_list, positive_number
        from gpipe_repro.repro import replicas_plan_table as table
        positive_number("--memory", memory, "GiB")
        positive_number("--tflops", tflops, "TFLOP/s")
        ms, ns = int_list("--m", m) or [], int_list("--devices", devices) or []
        if min(ms, default=0) < 1 or min(ns, default=0) < 1:
            raise typer.BadParameter(f"--m and --devices take counts >= 1, got {m} and {devices}")
        from gpipe_repro.report.output_guard import OutputRefused
        try:
            table.main(memory=memory, tflops=tflops, ms=ms, devices=ns, overwrite=overwrite, record=record)
        except OutputRefused as e:
            raise typer.BadParameter(str(e)) from None
