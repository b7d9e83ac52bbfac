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

    def reduce(self) -> None:
        """Give every copy this process holds the sum of all the copies' gradients."""
        for tie, ranks, group in self.mine:
            copies = tied_copies(tie, self.cells)
            total = copies_sum(copies)
            if len(ranks) > 1:
                total = self._all_reduce(copies[0], total, group, ranks)
            if total is not None:
                set_gradients(copies, total)

    def _all_reduce(self, param: nn.Parameter, total: torch.Tensor | None,
                    group: dist.ProcessGroup | None, ranks: list[int]) -> torch.Tensor | None:
        """The sum over `ranks` of their partial sums (None where no rank had a gradient)."""
        flat = torch.zeros(param.numel() + 1, dtype=param.dtype if total is None else total.dtype,
                           device=param.device)
        if total is not None:
            flat[:-1] = total.reshape(-1)
            flat[-1] = 1.0
        work = dist.all_reduce(flat, group=group, async_op=True)
        try:
            if work is not None:
                work.wait(self.timeout)
        except Exception as e:
            raise PeerFailure(f"rank {self.rank} lost a rank holding a tied parameter (ranks {ranks}) "
                              "while summing its gradients (it died, failed or did not answer within "
                              f"{self.timeout.total_seconds():g} s): {e}", None) from e
        return flat[:-1].view(param.shape) if float(flat[-1]) > 0 else None
