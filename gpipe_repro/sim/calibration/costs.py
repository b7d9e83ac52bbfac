"""Per-layer costs and a calibration (costs of one workload at several micro-batch sizes), with their JSON."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs on one micro-batch of a given size (seconds, FLOPs, bytes)."""

    forward: float           # FORWARD that keeps its graph (a non-checkpointed micro-batch)
    forward_nograd: float    # FORWARD of a checkpointed micro-batch (no_grad)
    recompute: float         # RECOMPUTE (graph rebuilt, BatchNorm statistics not accumulated)
    backward: float
    optimizer: float         # the OPTIMIZER_STEP's extra seconds for this layer: committing its
                             # BatchNorm statistics and updating its parameters (beyond the fixed
                             # cost of the optimizer call, Calibration.optimizer_call)
    forward_flops: float
    flops: float             # forward + backward
    params: int
    output_bytes: int        # the layer's output: what crosses a boundary cut after it
    grad_bytes: int          # the floating part of the output: what its gradient sends back
    accumulate: float = 0.0  # extra seconds of a BACKWARD adding into existing parameter gradients
                             # (every micro-batch of a step but the stage's first; `backward` is
                             # the first's, into fresh ones)
    backward_input: float | None = None   # the zero-bubble split as the stage executor runs it:
    backward_weight: float | None = None  # BACKWARD_INPUT, and BACKWARD_WEIGHT into existing
                                          # gradients (None: not measured, e.g. FLOP costs, or the
                                          # model's first layer, whose input takes no gradient)


def split_input(cost: LayerCost) -> float:
    """A layer's BACKWARD_INPUT: measured where the calibration timed the split, else its
    :func:`input_share` of the backward."""
    return cost.backward_input if cost.backward_input is not None else cost.backward * input_share(cost)


def split_weight(cost: LayerCost) -> float:
    """A layer's BACKWARD_WEIGHT into existing gradients: measured, else the rest of the backward
    plus the accumulation."""
    if cost.backward_weight is not None:
        return cost.backward_weight
    return cost.backward * (1.0 - input_share(cost)) + cost.accumulate


def input_share(cost: LayerCost) -> float:
    """The share of a layer's measured backward time that is its input gradient (the rest is its
    weight gradient), for the zero-bubble split (Qi et al., ICLR 2024). A FLOP-model approximation,
    not a measurement: a layer without parameters has only an input gradient (1.0); for a matmul
    or convolution the input gradient and the weight gradient each cost the forward's FLOPs
    (dX = dY W^T, dW = X^T dY: Qi et al. section 2, T_B = T_W), so 0.5. Layers mixing the two
    (normalization, attention) are counted at 0.5 too."""
    return 1.0 if cost.params == 0 else 0.5


#: LayerCost's fields that are counted, not timed: equal in every calibration of one model.
COUNTED = frozenset({"forward_flops", "flops", "params", "output_bytes", "grad_bytes"})


@dataclass
class Calibration:
    """Per-layer costs of one workload at several micro-batch sizes on one device."""

    workload: str
    method: str                           # "time" or "flops"
    device: str                           # "cpu: <model>, 1 thread", "cuda: H100", "flops: p100"
    groups: list[int]                     # per layer: index of its group of identical layers
    costs: dict[int, list[LayerCost]] = field(default_factory=dict)   # size -> per-layer costs
    optimizer_call: float = 0.0           # fixed seconds of one optimizer step call, once per cell
    uncertainty: dict[int, float] = field(default_factory=dict)   # size -> relative half-width of
                                          # the layers' shares of a round's cost over rounds (the
                                          # median layer's 95% interval): what can move a cut

    @property
    def num_layers(self) -> int:
        return len(self.groups)

    def at(self, size: int) -> list[LayerCost]:
        if size not in self.costs:
            raise KeyError(f"no calibration at micro-batch size {size} (have {sorted(self.costs)}); "
                           "calibrate at every micro-batch size the configuration uses")
        return self.costs[size]

    def uncertainty_at(self, size: int) -> float:
        """The relative uncertainty of the costs at `size` that can move a cut: the median layer's
        interval half-width of its share of a round's cost, over the calibration's rounds; 0.0
        where unknown (fewer than 3 rounds) or exact (FLOPs)."""
        return self.uncertainty.get(size, 0.0)

    def partition_costs(self, size: int, checkpoint: str = "always", split: bool = False) -> list[float]:
        """Per-layer cost the partitioner balances: the seconds of the actions one micro-batch runs
        through the layer (checkpointed forward + recompute + backward under re-materialization,
        forward + backward without), the backward adding into existing gradients as all of a step's
        micro-batches but the first do. `split`: the backward as a cell of a zero-bubble schedule
        runs it, its input half and its weight half (:func:`split_input`, :func:`split_weight`),
        which together cost more than one backward (two walks of the graph)."""
        def backward(c: LayerCost) -> float:
            return split_input(c) + split_weight(c) if split else c.backward + c.accumulate
        if checkpoint == "never":
            return [c.forward + backward(c) for c in self.at(size)]
        return [c.forward_nograd + c.recompute + backward(c) for c in self.at(size)]

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.workload, "method": self.method, "device": self.device,
                "groups": self.groups, "optimizer_call": self.optimizer_call,
                "uncertainty": {str(b): u for b, u in self.uncertainty.items()},
                "costs": {str(b): [asdict(c) for c in cs] for b, cs in self.costs.items()}}

    @classmethod
    def median_of(cls, calibrations: list[Calibration]) -> Calibration:
        """One calibration from several of the same workload and device, taken at different
        moments: at each of the first's micro-batch sizes, every timed field of every layer the
        median over the calibrations that hold that size (a later one may hold fewer: recalibrated
        at one size only), and so the uncertainty; the optimizer call the median of all; the counts
        (FLOPs, parameters, bytes) and the groups the first's."""
        first = calibrations[0]
        if any(c.groups != first.groups or not c.costs.keys() <= first.costs.keys() for c in calibrations):
            raise ValueError("calibrations of different layers or sizes cannot be pooled")

        def med(values: list[Any]) -> Any:
            return None if any(v is None for v in values) else statistics.median(values)
        timed = [f.name for f in fields(LayerCost) if f.name not in COUNTED]
        costs, uncertainty = {}, {}
        for size, layers in first.costs.items():
            holding = [c for c in calibrations if size in c.costs]
            costs[size] = [replace(layer, **{name: med([getattr(c.costs[size][i], name) for c in holding])
                                             for name in timed})
                           for i, layer in enumerate(layers)]
            if size in first.uncertainty:
                uncertainty[size] = statistics.median(c.uncertainty.get(size, 0.0) for c in holding)
        return cls(first.workload, first.method, first.device, list(first.groups), costs,
                   statistics.median(c.optimizer_call for c in calibrations), uncertainty)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        return cls(data["workload"], data["method"], data["device"], list(data["groups"]),
                   {int(b): [LayerCost(**c) for c in cs] for b, cs in data["costs"].items()},
                   float(data.get("optimizer_call", 0.0)),
                   {int(b): float(u) for b, u in data.get("uncertainty", {}).items()})


