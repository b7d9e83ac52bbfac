"""Randomness as a function of (seed, step, layer, micro-batch).

Why: a pipeline runs the same layers in a different order than a plain model (and in different
processes in the distributed runtime). If dropout drew from one shared stream, its masks would depend
on K, on the partition and on the interleaving of actions. Seeding the default generators before
each layer runs on each micro-batch makes masks a pure function of *which* computation is running:

- re-materialization replays exactly the masks of the original forward (same four numbers);
- K=1 and K=8, local and distributed, give the same numbers;
- a plain reference loop can reproduce the engine by calling :func:`seed_layer` itself.

The caller's own RNG stream is left as it was: :func:`preserved_rng` wraps each step.

A layer that draws from a ``torch.Generator`` of its own (an attribute of one of its modules) is not
reached by the seeding; :class:`PrivateGenerators` gives its recompute the generator's state of the
original forward, and puts the stream back afterwards, as if the recompute had not drawn (a layer
with its own generator trained gradients 0.11 off under the default checkpointing otherwise). Python's
``random`` and NumPy's global streams are not replayed (as with ``torch.utils.checkpoint``): draw
from torch's generators in a layer that is re-materialized.

The rule, exactly (so that a reference can re-implement it without this module): with
``mix`` = SplitMix64's finalizer (Steele, Lea & Flood, OOPSLA 2014; constants of Vigna's
splitmix64.c) on 64-bit unsigned integers, and negative numbers taken modulo 2^64::

    seed(seed, step, layer, m) = mix(mix(mix(mix(seed) ^ step) ^ layer) ^ m) & (2^63 - 1)

``torch.default_generator.manual_seed`` (and the CUDA generator of the cell's device) gets it right
before layer `layer` (its index in the whole model) runs on micro-batch `m` of step `step`.
Training steps count 0, 1, 2, ...; the k-th training-mode ``forward()`` call uses step -1 - k.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["step_key", "layer_seed", "seed_layer", "preserved_rng", "PrivateGenerators"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_key(seed: int, step: int) -> int:
    """The part of :func:`layer_seed` shared by a whole step (hoisted out of the per-layer loop)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


def layer_seed(seed: int, step: int, layer: int, microbatch: int, key: int | None = None) -> int:
    """A 63-bit seed that depends on all four numbers (and nothing else)."""
    h = step_key(seed, step) if key is None else key
    h = _splitmix64(h ^ (layer & _MASK64))
    h = _splitmix64(h ^ (microbatch & _MASK64))
    return h & ((1 << 63) - 1)


def seed_layer(seed: int, step: int, layer: int, microbatch: int,
               device: torch.device | None = None, key: int | None = None) -> None:
    """Seed the CPU generator, and the CUDA generator of `device` if it is a CUDA device.
    `key` may pass a precomputed :func:`step_key` (same result, less work)."""
    s = layer_seed(seed, step, layer, microbatch, key)
    torch.default_generator.manual_seed(s)
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(s)


@contextlib.contextmanager
def preserved_rng(devices: list[torch.device] | None = None) -> Iterator[None]:
    """Restore the CPU (and given CUDA devices') RNG state on exit."""
    cpu_state = torch.get_rng_state()
    cuda = sorted({d.index if d.index is not None else torch.cuda.current_device()
                   for d in (devices or []) if d.type == "cuda"})
    cuda_states = [torch.cuda.get_rng_state(i) for i in cuda]
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        for i, state in zip(cuda, cuda_states):
            torch.cuda.set_rng_state(state, i)


class PrivateGenerators:
    """The ``torch.Generator`` objects a cell's layers hold (attributes of their modules), and their
    states as each checkpointed micro-batch's forward found them, for its recompute (see the module
    docstring). `of`: layer index in the cell -> its generators; empty for most models, which then
    pay nothing."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.of: dict[int, list[torch.Generator]] = {}
        for i, layer in enumerate(layers):
            found = {id(v): v for mod in layer.modules() for v in vars(mod).values()
                     if isinstance(v, torch.Generator)}
            if found:
                self.of[i] = list(found.values())
        self._states: dict[tuple[int, int], list[torch.Tensor]] = {}

    def clear(self) -> None:
        """Drop states a failed step left."""
        self._states.clear()

    @contextlib.contextmanager
    def around(self, layer: int, microbatch: int, *, record: bool, recompute: bool) -> Iterator[None]:
        """Run layer `layer` on `microbatch`: keep its generators' states first where `record` (a
        forward whose micro-batch is recomputed later); at its `recompute`, draw from those states
        and restore the streams afterwards."""
        generators = self.of[layer]
        if recompute and (layer, microbatch) in self._states:
            now = [g.get_state() for g in generators]
            for g, state in zip(generators, self._states.pop((layer, microbatch))):
                g.set_state(state)
            try:
                yield
            finally:
                for g, state in zip(generators, now):
                    g.set_state(state)
            return
        if record:
            self._states[(layer, microbatch)] = [g.get_state() for g in generators]
        yield
