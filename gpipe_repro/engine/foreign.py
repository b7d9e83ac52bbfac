"""Another process's layers, reached by this process's step: refused before any update.

With ``runtime="distributed"`` every process builds the whole model and keeps its own cells; the
other layers stay in the caller's model, untrained there. A computation of this process that
reaches one of them would train something else than plain PyTorch, silently: a loss function that
reads ``model[0].weight`` (an L2 penalty) writes its gradient into this process's stale copy, which
no optimizer steps, and the process that trains the weight never sees it; a layer that holds another
cell's layer by a reference outside the module tree (``self.__dict__["enc"] = enc``) does the same;
a buffer two layers share, changed by the forward of one, changes only this process's copy. The
local runtime runs them all on the same tensors and trains as plain PyTorch does.

Where a parameter of another process's layer got a gradient or was changed in place between the
start of a step and its AGREE (every gradient final, nothing updated yet), :class:`ForeignState`
raises, naming the parameter and what to change. A buffer this process's layers share with another
process's is compared by value: a forward that sets it alike every time (a rotary cache built on
first use) changes it once; one that changes it in two steps in a row (a counter, a running
average) is refused at the second, as :mod:`~gpipe_repro.engine.layer_state` refuses it at the
second micro-batch. A read without a gradient (``other.weight.detach()``, under ``no_grad``) leaves
no trace to check: it reads the stale copy (docs/distributed.md says so). Each stage has its own
state: a process running two stages checks twice per step.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = ["ForeignState", "foreign_tensors"]


def _version(t: torch.Tensor | None) -> tuple[int, int] | None:
    return None if t is None else (id(t), t._version)


class ForeignState:
    """`parameters`: those of the layers this process does not hold (weakly: the process keeps
    its own cells only, and a caller that drops its model frees the others); `shared`: buffers its
    own layers share with them; each by a name that says where it is. See the module docstring."""

    def __init__(self, stage: int, parameters: Mapping[str, torch.Tensor],
                 shared: Mapping[str, torch.Tensor]) -> None:
        self.stage, self.shared = stage, dict(shared)
        self._parameters = {n: weakref.ref(p) for n, p in parameters.items()}
        self._grads: dict[str, tuple[int, int] | None] = {}
        self._versions: dict[str, tuple[int, int] | None] = {}
        self._values: dict[str, torch.Tensor] = {}
        self._changed_last_step: set[str] = set()

    @property
    def parameters(self) -> dict[str, torch.Tensor]:
        """The other processes' layers' parameters still alive."""
        alive = {n: r() for n, r in self._parameters.items()}
        return {n: p for n, p in alive.items() if p is not None}

    def begin_step(self) -> None:
        alive = self.parameters
        self._grads = {n: _version(p.grad) for n, p in alive.items()}
        self._versions = {n: _version(p) for n, p in alive.items()}
        self._values = {n: t.detach().clone() for n, t in self.shared.items()}

    def check(self) -> None:
        """Raise RuntimeError where this step reached a layer held by another process."""
        for name, p in self.parameters.items():
            if name not in self._grads:
                continue
            if _version(p.grad) != self._grads[name] or _version(p) != self._versions[name]:
                raise RuntimeError(
                    f"stage {self.stage}: this step computed a gradient for {name} (or changed it), a "
                    "parameter of a layer another process trains (runtime='distributed' keeps each "
                    "process's cells only): the loss function or a layer of this stage uses it (a "
                    "penalty on another layer's weight, a reference to another layer kept outside "
                    "the module tree), so its gradient would be lost and its value is stale. Compute "
                    "that term in a layer of the cell that holds the parameter, register the shared "
                    "parameter in both layers (the engine keeps tied parameters equal), or use "
                    "runtime='local'")
        changed = {n for n, t in self.shared.items()
                   if n in self._values and not torch.equal(t.detach(), self._values[n])}
        again = sorted(changed & self._changed_last_step)
        self._changed_last_step = changed
        if again:
            raise RuntimeError(
                f"stage {self.stage}: this stage's layers share {again[0]}, held by another "
                "process too, and change it at every step (runtime='distributed' keeps each "
                "process's cells only, so each "
                "process would change its own copy; plain PyTorch changes one tensor from both "
                "layers). Give each layer a buffer of its own, or use runtime='local'")


def foreign_tensors(cells: Sequence[nn.Sequential], here: Sequence[int], balance: Sequence[int]
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What this process's step must not reach of the cells other processes hold
    (`here`: its stages): their layers' parameters, and the buffers they share with this process's
    layers, each by a name that says where it is (`balance`: the layers per cell)."""
    own_params = {id(p) for s in here for p in cells[s].parameters()}
    own_buffers = {id(b): b for s in here for b in cells[s].buffers()}
    parameters: dict[str, torch.Tensor] = {}
    shared: dict[str, torch.Tensor] = {}
    for s, cell in enumerate(cells):
        if s in here:
            continue
        for j, layer in enumerate(cell):
            where = f"layer {sum(balance[:s]) + j} ({type(layer).__name__})"
            for name, p in layer.named_parameters():
                if id(p) not in own_params:
                    parameters.setdefault(f"{where} parameter {name!r}", p)
            for name, b in layer.named_buffers():
                if id(b) in own_buffers:
                    shared.setdefault(f"{where} buffer {name!r}", b)
    return parameters, shared
