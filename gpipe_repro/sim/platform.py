"""The simulated machine beyond compute: its link and the runtime's fixed per-step costs."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpipe_repro.sim.calibration import Calibration
from gpipe_repro.sim.links import LinkModel, get_link, measure_runtime_overheads
from gpipe_repro.sim.simulator import Simulation, simulate_config


class ScheduleSettings(Protocol):
    """What :meth:`Platform.simulate` reads from a sweep's settings."""

    @property
    def checkpoint(self) -> str: ...
    @property
    def recompute_ahead(self) -> bool: ...
    @property
    def schedule(self) -> str: ...


@dataclass(frozen=True)
class Platform:
    """The simulated machine beyond compute: its link, and the runtime's fixed cost per step."""

    link: LinkModel
    setup: float = 0.0       # seconds before a step's first action
    teardown: float = 0.0    # seconds after its last action

    def simulate(self, calib: Calibration, balance: Sequence[int], m: int, n: int,
                 settings: ScheduleSettings, checkpoint: str | None = None,
                 recompute_ahead: bool | None = None) -> Simulation:
        return simulate_config(calib, balance, m, n, self.link,
                               checkpoint=checkpoint or settings.checkpoint,
                               recompute_ahead=(settings.recompute_ahead if recompute_ahead is None
                                                else recompute_ahead),
                               schedule=settings.schedule, setup=self.setup,
                               teardown=self.teardown)

    def to_json(self) -> dict[str, Any]:
        return {**self.link.to_json(), "step_setup": self.setup, "step_teardown": self.teardown}


def platform_for(link_name: str) -> Platform:
    """A preset link as is; the host's gloo loopback with the distributed runtime's own measured
    overheads (per message and per step), since that is what a measured run pays."""
    link = get_link(link_name)
    if link_name != "gloo-loopback":
        return Platform(link)
    over = measure_runtime_overheads()
    return Platform(link.with_overheads(over.send, over.recv), over.setup, over.teardown)

