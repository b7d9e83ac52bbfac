"""The paper's Table 1 (maximum model size per device count) reproduced with the memory planner.

Every number here is *simulated* (the planner on fake tensors: no device of that size is needed),
labelled so in the JSON, with the paper's value beside it (:mod:`gpipe_repro.paper`). What is
decided here, and why:

- **Budget**: the paper's per-accelerator memory (8 GB AmoebaNet, 16 GB Transformer) read as GiB
  (TPU HBM is 8/16 GiB per core; the paper's "param memory" column is in GiB: 785.8M x 12 B =
  8.8 GiB).
- **Micro-batches**: the paper does not state M. We use the same M for every pipeline row
  (default 8). With M=8 our Transformer Pipeline-1 row reproduces the paper's exactly (13 layers
  and 6.4 GiB peak activation), which suggests that is what the paper ran. Naive-1 is K=1, M=1, no
  re-materialization; Pipeline-K re-materializes every micro-batch but the last (the engine's
  ``except_last``).
- **Optimizer**: RMSProp with one slot (12 bytes per parameter with weight and gradient), updating
  a cell in one multi-tensor pass as on CUDA (its temporaries count at the step).
- **Attention**: PyTorch's fused kernel (what the engine runs). The ``math`` variant materializes
  the attention matrix, as XLA did on the paper's TPUs: the two bracket the paper's numbers.
- **Partition**: cells that minimize the largest per-device memory (the planner's default).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpipe_repro.memory.planner import GiB, MemoryPlan
from gpipe_repro.memory.profile import ProfileCache
from gpipe_repro.memory.search import Found, Row, search_amoebanet, search_transformer, transformer_planner
from gpipe_repro.paper import TABLE1_AMOEBANET, TABLE1_TRANSFORMER
from gpipe_repro.report.records import simulated


@dataclass(frozen=True)
class Table1Settings:
    micro_batches: int = 8
    transformer_ks: tuple[int, ...] = (1, 8, 32, 128)
    amoebanet_ks: tuple[int, ...] = (1, 2, 4, 8)
    attention_variants: tuple[str, ...] = ("fused", "math")


def _gib(x: float | None) -> float | None:
    return None if x is None else x / GiB


def _devices(plan: MemoryPlan) -> list[dict[str, Any]]:
    return [{"stage": s.stage, "layers": n, "peak_gib": simulated(_gib(s.peak), unit="GiB"),
             "peak_at": s.peak_at, "method": "simulated",
             "parts_gib": {k: round(v / GiB, 4) for k, v in sorted(s.parts.items())}}
            for s, n in zip(plan.stages, plan.balance)]


def _paper_number(paper: Mapping[str, object], key: str) -> float | None:
    """The paper's number under `key`; None where the row has none."""
    value = paper.get(key)
    return value if isinstance(value, (int, float)) else None


def row_record(found: Found, paper: Mapping[str, object], size_keys: Sequence[str]) -> dict[str, Any]:
    """One column of Table 1 as data: ours (simulated) with the paper's value beside it. `paper`: the
    paper's column (a :class:`~gpipe_repro.paper.Table1Row`, or any part of one)."""
    row, plan = found.row, found.plan
    out: dict[str, Any] = {"name": row.name, "partitions": row.partitions,
                           "micro_batches": row.micro_batches, "checkpoint": row.checkpoint}
    for i, key in enumerate(size_keys):
        out[key] = simulated(None if found.size is None else found.size[i],
                             paper=_paper_number(paper, key))
    out["params"] = simulated(None if plan is None else plan.parameters,
                              paper=_paper_number(paper, "params"))
    out["param_memory_gib"] = simulated(_gib(plan.state_memory if plan else None),
                                        paper=_paper_number(paper, "param_memory_gb"), unit="GiB")
    out["peak_activation_gib"] = simulated(_gib(plan.activation_memory if plan else None),
                                           paper=_paper_number(paper, "peak_activation_gb"), unit="GiB")
    out["max_device_peak_gib"] = simulated(_gib(plan.max_peak if plan else None), unit="GiB")
    if plan is not None:
        out["balance"] = plan.balance
        out["devices"] = _devices(plan)
    if found.deeper is not None and found.deeper_plan is not None:
        out["deeper"] = {"size": list(found.deeper), "params": found.deeper_plan.parameters}
    out["plans_tried"] = len(found.tried)
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Parameters relative to Naive-1, ours and the paper's."""
    base = rows[0]["params"]
    for r in rows:
        ours = (r["params"]["value"] / base["value"]
                if r["params"]["value"] and base["value"] else None)
        paper = (r["params"]["paper"] / base["paper"]
                 if r["params"].get("paper") and base.get("paper") else None)
        r["ratio_to_naive"] = simulated(ours, paper=paper, unit="x")


def transformer_rows(settings: Table1Settings, cache: ProfileCache, attention: str = "fused",
                     budget_gib: Callable[[str], float] | None = None) -> list[dict[str, Any]]:
    """Transformer-L: the largest L per row. `budget_gib(row name)` overrides the 16 GiB."""
    paper = TABLE1_TRANSFORMER
    rows = [Row.naive()] + [Row.pipeline(k, settings.micro_batches) for k in settings.transformer_ks]
    out = []
    for row in rows:
        gib = budget_gib(row.name) if budget_gib else paper["device_memory_gb"]
        found = search_transformer(row, gib * GiB, cache, attention)
        rec = row_record(found, paper["rows"].get(row.name, {}), ("L",))
        rec["budget_gib"] = gib
        out.append(rec)
    add_ratios(out)
    return out


def paper_used_gib(row_name: str) -> float:
    """What the paper's Transformer row reports using per device: (param + peak activation) / K."""
    r = TABLE1_TRANSFORMER["rows"][row_name]
    k = 1 if row_name == "Naive-1" else int(row_name.split("-")[1])
    return (r["param_memory_gb"] + r["peak_activation_gb"]) / k


def naive_head_breakdown(cache: ProfileCache) -> dict[str, Any]:
    """Why Naive-1 fits no Transformer layer in eager PyTorch: what the embedding, one layer, the
    softmax head and the loss each hold for a 32 x 1024-token batch (measured on fake tensors)."""
    planner = transformer_planner(1, cache)
    profs = planner.profiles(planner.batch)
    parts = {}
    for p in profs:
        parts[p.name] = {"forward_peak_gib": simulated(_gib(p.fwd_peak), unit="GiB"),
                         "kept_for_backward_gib": simulated(_gib(p.saved_internal + p.out_new_bytes()),
                                                            unit="GiB"),
                         "backward_peak_gib": simulated(_gib(p.bwd_peak[0][0]), unit="GiB")}
    plans = {L: transformer_planner(L, cache).plan(1, 1, "never") for L in (0, 1)}
    return {"per_layer": parts,
            "naive_peak_gib": {f"L={L}": simulated(_gib(p.max_peak), unit="GiB")
                               for L, p in plans.items()}}


def amoebanet_rows(settings: Table1Settings, cache: ProfileCache) -> list[dict[str, Any]]:
    """AmoebaNet-D: at each row's paper depth, the widest D; then the deepest L at that width."""
    paper = TABLE1_AMOEBANET
    budget = paper["device_memory_gb"] * GiB
    rows = [Row.naive()] + [Row.pipeline(k, settings.micro_batches) for k in settings.amoebanet_ks]
    out = []
    for row in rows:
        p = paper["rows"][row.name]
        found = search_amoebanet(row, budget, cache, L=p["L"])
        rec = row_record(found, p, ("L", "D"))
        rec["budget_gib"] = paper["device_memory_gb"]
        out.append(rec)
    add_ratios(out)
    return out


def amoebanet_paper_models(settings: Table1Settings, cache: ProfileCache) -> list[dict[str, Any]]:
    """The paper's own (L, D) per row, planned under our accounting: how much each device would
    need, against the 8 GiB the paper fitted it in."""
    from gpipe_repro.memory.search import amoebanet_planner
    paper = TABLE1_AMOEBANET
    rows = [Row.naive()] + [Row.pipeline(k, settings.micro_batches) for k in settings.amoebanet_ks]
    out = []
    for row in rows:
        p = paper["rows"][row.name]
        planner = amoebanet_planner(p["L"], p["D"], cache)
        plan = planner.plan(row.partitions, row.micro_batches, row.checkpoint)
        out.append({"name": row.name, "L": p["L"], "D": p["D"], "micro_batches": row.micro_batches,
                    "params": simulated(plan.parameters, paper=p["params"]),
                    "max_device_peak_gib": simulated(_gib(plan.max_peak),
                                                     paper=paper["device_memory_gb"], unit="GiB"),
                    "peak_activation_gib": simulated(_gib(plan.activation_memory),
                                                     paper=p["peak_activation_gb"], unit="GiB")})
    return out


__all__ = ["Table1Settings", "amoebanet_paper_models", "transformer_rows", "amoebanet_rows",
           "naive_head_breakdown", "paper_used_gib", "row_record", "add_ratios"]
