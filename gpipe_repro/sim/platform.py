"""The simulated machine beyond compute: its link and the runtime's fixed per-step costs."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpipe_repro.sim.calibration import Calibration
from gpipe_repro.sim.jitter import Jitter, measure_jitter
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
    @property
    def split_backwards(self) -> int | None: ...


@dataclass(frozen=True)
class Platform:
    """The simulated machine beyond compute: its link, and the runtime's fixed cost per step."""

    link: LinkModel
    setup: float = 0.0       # seconds before a step's first action
    teardown: float = 0.0    # seconds after its last action
    jitter: Jitter | None = None   # drawn action durations (sim/jitter); None: exact costs

    def simulate(self, calib: Calibration, balance: Sequence[int], m: int, n: int,
                 settings: ScheduleSettings, checkpoint: str | None = None,
                 recompute_ahead: bool | None = None) -> Simulation:
        return simulate_config(calib, balance, m, n, self.link,
                               checkpoint=checkpoint or settings.checkpoint,
                               recompute_ahead=(settings.recompute_ahead if recompute_ahead is None
                                                else recompute_ahead),
                               schedule=settings.schedule,
                               split_backwards=settings.split_backwards, setup=self.setup,
                               teardown=self.teardown, jitter=self.jitter)

    def to_json(self) -> dict[str, Any]:
        out = {**self.link.to_json(), "step_setup": self.setup, "step_teardown": self.teardown}
        if self.jitter is not None:
            out["jitter"] = {"source": self.jitter.source,
                             "length_s_and_cv": [list(pair) for pair in self.jitter.spread()]}
        return out


def platform_for(link_name: str, *, jitter: bool = False) -> Platform:
    """A preset link as is; the host's gloo loopback with the distributed runtime's own measured
    overheads (per message and per step), since that is what a measured run pays, and with
    `jitter` this host's measured variation of action durations (:mod:`gpipe_repro.sim.jitter`):
    what a simulation compared with this host's measured steps needs. A preset link is another
    machine: no jitter of this host's."""
    link = get_link(link_name)
    if link_name != "gloo-loopback":
        return Platform(link)
    over = measure_runtime_overheads()
    return Platform(link.with_overheads(over.send, over.recv), over.setup, over.teardown,
                    measure_jitter() if jitter else None)

