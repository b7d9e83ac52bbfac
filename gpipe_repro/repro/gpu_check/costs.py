"""Part 4: per-layer costs measured on the device, and Tables 2 and 3 simulated from them.

The paper's models (Table 2: AmoebaNet-D (18, 256) at 224x224 and Transformer-48, d 2048, ff 8192,
seq 1024; Table 3: AmoebaNet-D (18, 128) and Transformer-24) are calibrated on the device by
:func:`gpipe_repro.sim.calibration.calibrate` (every action the schedule runs, timed per distinct
layer at the micro-batch size used: 8 images, 1 sequence of 1024 tokens). For every (K, M) the
layers are cut by the exact bottleneck partitioner on those costs and one step is simulated
(:func:`gpipe_repro.sim.simulator.simulate_config`: the engine's schedule, re-materialization on)
with each link model below; throughput is normalized to K=2, M=1 (Table 2) or K=2 (Table 3, M=32),
as the paper does. Beside it: the FLOP model of the same model on the paper's device (Table 2: a
TPUv3 core with its inter-chip link; Table 3: a P100 on PCIe; :data:`gpipe_repro.sim.calibration.DEVICES`)
and the paper's number.

Link models: ``nvlink`` and ``pcie`` are the simulator's presets (V100 NVLink 2.0, ~100 GB/s;
P100 on PCIe 3.0 x16, ~10 GB/s; sources in :mod:`gpipe_repro.sim.links`). Two current links are added
here, as the same fraction of their peak as those presets achieve:

- ``nvlink4``: H100 SXM5, NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction peak (NVIDIA H100
  Tensor Core GPU Architecture whitepaper, 2022); 2/3 of peak assumed achieved (the nvlink preset's
  100 of 150 GB/s): 300 GB/s, 5 us.
- ``pcie5``: PCIe 5.0 x16: 32 GT/s x 16 lanes x 128/130 = 63 GB/s per direction peak (PCI-SIG PCI
  Express Base Specification 5.0, 2019); the pcie preset's 10 of 15.75 GB/s ratio assumed: 40 GB/s,
  10 us.

Every simulated number is labelled simulated; the per-layer costs they come from are measured.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from gpipe_repro.repro.gpu_check import _deps

TABLE3_M = 32


def link_models() -> dict[str, Any]:
    """The link models of the simulation (see the module docstring)."""
    link = _deps.LinkModel
    return {
        "nvlink": _deps.PRESETS["nvlink"],
        "pcie": _deps.PRESETS["pcie"],
        "nvlink4": link("nvlink4", 5e-6, 300e9,
                        source="H100 SXM5 NVLink 4: 450 GB/s per direction peak (NVIDIA H100 architecture "
                               "whitepaper, 2022), 2/3 achieved assumed: 300 GB/s, 5 us"),
        "pcie5": link("pcie5", 10e-6, 40e9,
                      source="PCIe 5.0 x16: 63 GB/s per direction peak (PCI-SIG PCIe Base Specification "
                             "5.0, 2019), the pcie preset's 63% achieved assumed: 40 GB/s, 10 us"),
    }


def _workload(spec: dict[str, Any]) -> Any:
    return _deps.Workload.create(spec["name"], spec["family"], spec["kind"], spec["shape"], spec["classes"],
                                 **spec["options"])


def simulate_table(calib: Any, microbatch: int, ks: tuple[int, ...], ms: tuple[int, ...],
                   link: Any, base: tuple[int, int]) -> dict[tuple[int, int], dict[str, Any]]:
    """(K, M) -> balance, throughput and normalized throughput of one simulated table."""
    costs = calib.partition_costs(microbatch, "always")
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for k in ks:
        balance = _deps.partition(costs, k, "bottleneck")
        for m in ms:
            sim = _deps.simulate_config(calib, balance, m, m * microbatch, link, checkpoint="always",
                                        recompute_ahead=False)
            out[(k, m)] = {"balance": balance, "throughput": sim.throughput,
                           "bubble_fraction": sim.bubble_fraction}
    ref = out[base]["throughput"]
    for v in out.values():
        v["normalized"] = v["throughput"] / ref
    return out


def table_rows(model: str, measured_calib: Any, flop_calib: Any, spec: dict[str, Any], ks: tuple[int, ...],
               ms: tuple[int, ...], flop_link: Any, paper_values: dict[tuple[int, int], float],
               base: tuple[int, int]) -> list[dict[str, Any]]:
    """One model's rows: simulated from measured costs per link, the FLOP model, the paper."""
    b = spec["microbatch"]
    per_link = {name: simulate_table(measured_calib, b, ks, ms, link, base)
                for name, link in link_models().items()}
    flop = simulate_table(flop_calib, b, ks, ms, flop_link, base)
    rows = []
    for k in ks:
        for m in ms:
            rows.append({"model": model, "K": k, "M": m, "microbatch": b, "batch": m * b,
                         "balance": per_link["nvlink"][(k, m)]["balance"],
                         "links": {name: {"normalized": _deps.simulated(t[(k, m)]["normalized"],
                                                                        paper=paper_values.get((k, m))),
                                          "throughput": _deps.simulated(t[(k, m)]["throughput"],
                                                                        unit="samples/s"),
                                          "bubble_fraction": t[(k, m)]["bubble_fraction"]}
                                   for name, t in per_link.items()},
                         "flop_model": _deps.simulated(flop[(k, m)]["normalized"],
                                                       paper=paper_values.get((k, m))),
                         "paper": paper_values.get((k, m))})
    return rows


def calibration_summary(calib: Any, microbatch: int) -> dict[str, Any]:
    """Measured seconds of one micro-batch's forward + backward through the whole model."""
    costs = calib.at(microbatch)
    return {"device": calib.device, "layers": calib.num_layers, "distinct_layers": len(set(calib.groups)),
            "microbatch": microbatch,
            "forward_backward_s": _deps.measured(sum(c.forward + c.backward for c in costs), unit="s"),
            "recompute_s": _deps.measured(sum(c.recompute for c in costs), unit="s"),
            "optimizer_s": _deps.measured(calib.optimizer_call + sum(c.optimizer for c in costs), unit="s"),
            "flops_per_microbatch": sum(c.flops for c in costs)}


def run_costs_check(settings: Any, device: torch.device) -> dict[str, Any]:
    """Calibrate the Table 2 and 3 models on the device and simulate both tables (module doc)."""
    t0 = time.perf_counter()
    deadline = t0 + settings.budgets_s.get("costs", float("inf"))
    threads = 1 if device.type == "cpu" else None
    tables: dict[str, Any] = {"table2": {}, "table3": {}}
    calibrations: dict[str, Any] = {"table2": {}, "table3": {}}
    skipped = []
    measured: dict[tuple[str, int], Any] = {}
    plan = [("table2", settings.costs_table2, settings.costs_ms, "tpu-v3-core", "tpu-ici", (2, 1)),
            ("table3", settings.costs_table3, (TABLE3_M,), "p100", "pcie", (2, TABLE3_M))]
    for table, specs, ms, flop_device, flop_link, base in plan:
        for model, spec in specs.items():
            if time.perf_counter() > deadline:
                skipped.append(f"{table} {model}: time budget spent")
                continue
            work = _workload(spec)
            b = spec["microbatch"]
            key = (work.key(), b)
            if key not in measured:      # a model in both tables is timed once per run
                measured[key] = _deps.calibrate(work, [b], method="time", device=device, threads=threads,
                                                repeats=settings.costs_repeats, use_cache=False)
            calib = measured[key]
            flop_calib = _deps.calibrate(work, [b], method="flops", device_model=_deps.DEVICES[flop_device])
            paper_values = (dict(_deps.paper.TABLE2[model]) if table == "table2" else
                            {(k, TABLE3_M): v for k, v in _deps.paper.TABLE3[model].items()})
            ks = tuple(k for k in settings.costs_ks if k <= calib.num_layers)
            if 2 not in ks:
                skipped.append(f"{table} {model}: fewer than 2 layers")
                continue
            tables[table][model] = table_rows(model, calib, flop_calib, spec, ks, ms,
                                              _deps.PRESETS[flop_link], paper_values, base)
            calibrations[table][model] = {"workload": work.name, **calibration_summary(calib, b),
                                          "flop_model_device": _deps.DEVICES[flop_device].source,
                                          "flop_model_link": _deps.PRESETS[flop_link].source}
    return {"tables": tables, "calibrations": calibrations, "skipped": skipped,
            "links": {name: link.to_json() for name, link in link_models().items()},
            "normalized_to": {"table2": "K=2, M=1", "table3": f"K=2, M={TABLE3_M}"},
            "methods": {"tables.links": "simulated from per-layer costs measured on the device",
                        "tables.flop_model": "simulated from FLOP counts on a model of the paper's device",
                        "tables.paper": "the paper", "calibrations": "measured on the device"},
            "seconds": time.perf_counter() - t0}


__all__ = ["run_costs_check", "link_models", "simulate_table", "table_rows", "TABLE3_M"]
