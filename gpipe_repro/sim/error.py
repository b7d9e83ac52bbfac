"""The simulator's error against measured steps: one sample per measured step.

Error = simulated throughput / measured - 1 = measured step / simulated step - 1; its figure is the
median of the samples with a 95% interval (:class:`gpipe_repro.report.measurement.Figure`). Measured
in rounds, each round's steps are set against the simulation from that round's own calibration
(:func:`paired_error_figure`), so that the host's speed, which drifts over minutes, moves both sides
of each ratio alike; :func:`error_figure` is the one-simulation case.
"""
from __future__ import annotations

from collections.abc import Sequence

from gpipe_repro.report.measurement import Figure

ERROR_NAME = "simulated throughput / measured - 1"


def paired_error_figure(rounds: Sequence[tuple[Sequence[float], float]],
                        host_fast: float | None = None) -> Figure:
    """The error with each round's measured steps against that round's simulated step: `rounds` is
    a (measured steps, simulated step) per round."""
    if not rounds or any(s <= 0 or not steps for steps, s in rounds):
        raise ValueError("need a positive simulated step and at least one measured step per round")
    return Figure.of(ERROR_NAME, [t / s - 1 for steps, s in rounds for t in steps], unit="",
                     host_fast=host_fast, per="steps")


def error_figure(step_times: Sequence[float], simulated_step: float,
                 host_fast: float | None = None) -> Figure:
    """The error of one simulated step against each measured step."""
    return paired_error_figure([(step_times, simulated_step)], host_fast)
