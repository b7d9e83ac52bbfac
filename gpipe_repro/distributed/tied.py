"""Summing a tied parameter's gradients between the processes holding its copies.

Each cell holding a parameter tied across cells keeps its own copy (:mod:`gpipe_repro.engine.tied`).
At the step's agreement point, before AGREE's vector is computed, every copy's gradient becomes the
sum of all the copies' gradients: this process first adds up the copies it holds itself (interleaved
and zb-v put several cells on one process: zb-v's first and last cells share process 0), then one
all-reduce per tie sums those partial sums over the processes of this replica holding a copy
(Megatron-LM's embedding-group all-reduce). A tie whose copies all sit on this process needs no
collective. With replicas, each stage's gradients were already summed over the replicas (the
data-parallel reducer finishes first), so the tie's all-reduce stays within one replica.

The process groups are built once per job: every rank computes the same ties from the same model and
creates, in the same order, one group per (replica, tie spanning several processes) -- the ranks
holding it in that replica -- as :func:`gpipe_repro.distributed.groups.build_groups` does for the
replicas; groups with the same ranks are created once and reused by every later pipeline.

A copy that took no part in the step (no gradient on any holder) keeps None: each all-reduce carries
one presence flag.
"""
from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from gpipe_repro.distributed.groups import Layout
from gpipe_repro.distributed.watchdog import PeerFailure
from gpipe_repro.engine.tied import Tie, copies_sum, set_gradients, tied_copies

__all__ = ["TiedGradientReducer", "tie_ranks"]

_built: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup | None] = {}


def tie_ranks(tie: Tie, layout: Layout, process_of: Sequence[int], replica: int) -> list[int]:
    """The global ranks of `replica` holding a copy of `tie`, in rank order."""
    return sorted({layout.rank(replica=replica, stage=process_of[c]) for c in tie.cells})


def _group(ranks: list[int]) -> dist.ProcessGroup | None:
    """The process group of `ranks` (collective when first asked: every rank asks in the same order)."""
    key = (id(dist.group.WORLD), tuple(ranks))
    if key not in _built:
        _built[key] = None if len(ranks) == dist.get_world_size() else dist.new_group(ranks)
    return _built[key]


class TiedGradientReducer:
    """Sums each tie's gradients over this process's copies and the other processes' (see the module
    docstring).

    Args:
        ties: every tie of the model (the same list on every rank).
        cells: this process's cells, stage -> cell.
        layout: the job's processes x replicas; process_of: the process running each stage.
        rank: this process's global rank; timeout_s: how long to wait for a silent peer.
    """

    def __init__(self, ties: Sequence[Tie], cells: Mapping[int, nn.Module], layout: Layout,
                 process_of: Sequence[int], rank: int, timeout_s: float) -> None:
        self.ties, self.cells, self.rank = list(ties), dict(cells), rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        replica = layout.replica_of(rank)
        # (tie, its ranks in this replica, their group): every rank creates every group, in order
        self.mine: list[tuple[Tie, list[int], dist.ProcessGroup | None]] = []
        for r in range(layout.replicas):
            for tie in self.ties:
                ranks = tie_ranks(tie, layout, process_of, r)
                group = _group(ranks) if len(ranks) > 1 else None
                if r == replica and any(c in self.cells for c in tie.cells):
                    self.mine.append((tie, ranks, group))
        self.settle()

    def settle(self) -> None:
        """Note the copies' version counters: after each step's update, and as the job begins. A copy
        whose counter moved by the next step's AGREE was changed in place meanwhile (between steps,
        by the caller or ``load_state_dict``; or by a forward), and the copies are compared then."""
        self._versions = {(id(tie), c, name): self.cells[c].get_parameter(name)._version
                          for tie, _, _ in self.mine for c, name in tie.holders if c in self.cells}

    def _moved(self, tie: Tie) -> bool:
        return any(self.cells[c].get_parameter(name)._version != self._versions.get((id(tie), c, name))
                   for c, name in tie.holders if c in self.cells)

    def reduce(self) -> None:
        """Give every copy this process holds the sum of all the copies' gradients; where a copy was
        changed in place since the last update (on any rank holding one: each all-reduce carries
        a flag), refuse the step unless the copies are still equal (ValueError on every rank
        holding one, before any update)."""
        for tie, ranks, group in self.mine:
            copies = tied_copies(tie, self.cells)
            total = copies_sum(copies)
            moved = self._moved(tie)
            if len(ranks) > 1:
                total, moved = self._all_reduce(copies[0], total, moved, group, ranks)
            if moved:
                self._refuse_diverged(tie, copies, group, ranks)
            if total is not None:
                set_gradients(copies, total)

    def _all_reduce(self, param: nn.Parameter, total: torch.Tensor | None, moved: bool,
                    group: dist.ProcessGroup | None, ranks: list[int]) -> tuple[torch.Tensor | None, bool]:
        """The sum over `ranks` of their partial sums (None where no rank had a gradient), and whether
        a copy moved on any of them."""
        flat = torch.zeros(param.numel() + 2, dtype=param.dtype if total is None else total.dtype,
                           device=param.device)
        if total is not None:
            flat[:-2] = total.reshape(-1)
            flat[-2] = 1.0
        if moved:
            flat[-1] = 1.0
        self._wait(dist.all_reduce(flat, group=group, async_op=True), ranks, "summing its gradients")
        present, moved_anywhere = flat[-2:].tolist()
        return (flat[:-2].view(param.shape) if present > 0 else None), moved_anywhere > 0

    def _wait(self, work: dist.Work | None, ranks: list[int], doing: str) -> None:
        try:
            if work is not None:
                work.wait(self.timeout)
        except Exception as e:
            raise PeerFailure(f"rank {self.rank} lost a rank holding a tied parameter (ranks {ranks}) "
                              f"while {doing} (it died, failed or did not answer within "
                              f"{self.timeout.total_seconds():g} s): {e}", None) from e

    def _refuse_diverged(self, tie: Tie, copies: list[nn.Parameter], group: dist.ProcessGroup | None,
                         ranks: list[int]) -> None:
        """ValueError, on every rank holding a copy alike, where the copies differ (here, or between
        ranks: an elementwise max and min over them)."""
        first = copies[0].detach()
        here = all(torch.equal(c.detach().to(first.device), first) for c in copies[1:])
        if len(ranks) > 1:
            high, low = first.clone(), first.clone()
            flags = torch.tensor([0.0 if here else 1.0], dtype=first.dtype, device=first.device)
            self._wait(dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group, async_op=True), ranks,
                       "comparing its copies")
            self._wait(dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group, async_op=True), ranks,
                       "comparing its copies")
            self._wait(dist.all_reduce(flags, group=group, async_op=True), ranks, "comparing its copies")
            same = bool(((high == low) | (high.isnan() & low.isnan())).all()) and float(flags[0]) == 0
        else:
            same = here
        if same:
            return
        c, name = tie.holders[0]
        raise ValueError(
            f"parameter {name!r} (cell {c}), tied across cells {', '.join(str(x) for x in tie.cells)}, "
            f"differs between its copies (held by ranks {ranks}) as this step reaches its update: one "
            "was changed in place on some ranks only since the last update (between steps, or by "
            "load_state_dict or load_training_state on one rank), or by a forward in one cell. The "
            "step is refused before any update. Change it alike on every rank holding a copy, and "
            "load each rank's own training state")
