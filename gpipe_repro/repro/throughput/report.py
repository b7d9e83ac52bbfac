"""The throughput table's markdown: the paper's layout, the detail tables, the differences."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpipe_repro.report.host import BUSY_MARK, IDLE_CLEAN, OTHERS_CLEAN, busy_note
from gpipe_repro.report.measurement import Figure
from gpipe_repro.report.records import markdown_table
from gpipe_repro.repro.throughput.schedules import render_schedule_ablation
from gpipe_repro.sim.partition_choice import KEEP_BAND, TIE_FLOOR


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def measured_host(meas: dict[str, Any]) -> dict[str, Any] | None:
    """The host conditions recorded with a measured cell (results written before they were recorded
    under ``"host"`` kept ``host_idle_before`` and ``load_average``)."""
    if meas.get("host"):
        return dict(meas["host"])
    if meas.get("host_idle_before") is not None:
        return {"idle_fraction_before": meas["host_idle_before"],
                "load_average_before": (meas.get("load_average") or [None])[0]}
    return None


def measured_note(meas: dict[str, Any], normalized: bool = False) -> str:
    """What goes beside a measured number: its 95% interval where the measurement kernel measured
    it (a busy host widens it); for a cell recorded before that, the visible mark of a number not
    taken on an idle host ("" when clean; a normalized number: when either measurement was not)."""
    figure = meas.get("normalized_figure" if normalized else "step_figure")
    if figure is not None:
        low, high = figure.get("low"), figure.get("high")
        if not normalized and low is not None and high is not None:   # per-sample time -> samples/s
            low, high = 1.0 / high, 1.0 / low
        note = Figure.from_json(figure).coverage_note     # a range of 3 to 5 rounds: its coverage
        return f" [{_num(low, 2 if normalized else 1)}, {_num(high, 2 if normalized else 1)}]{note}"
    if normalized and "normalized_clean" in meas:
        if meas["normalized_clean"]:
            return ""
        own = busy_note(measured_host(meas))
        return own or f" {BUSY_MARK}busy (its K=2, M=1 reference)"
    return busy_note(measured_host(meas))


def calibration_uncertainty(calibrations: dict[str, Any], payload: dict[str, Any] | None = None) -> str:
    """How far the calibrated costs could move a cut: each model's share spread over rounds; and,
    given the table's `payload`, how many cuts were kept from the earlier table."""
    parts = [f"{model} {float(u):.1%} at micro-batch {size}" for model, c in calibrations.items()
             for size, u in (c.get("uncertainty") or {}).items()]
    return ("**Calibration uncertainty** (the median layer's 95% interval of its share of a round's "
            "cost, over interleaved rounds): " + ", ".join(parts) + ". Cuts whose simulated "
            f"bottleneck lies within it (or within {TIE_FLOOR:.0%}, where it is smaller) of the best "
            "are ties: " + kept_cuts_note(payload or {}))


def kept_cuts_note(payload: dict[str, Any]) -> str:
    """Which rule chose the ties' cut: kept from the earlier table, or the tie-break."""
    rule = ("the most even cut in time (least sum of squared cell costs), then the smallest balance, "
            "chooses among them")
    source = payload.get("cuts_from")
    if not source:
        return rule + " (every cut chosen afresh)."
    rows = [r for table in ("table2", "table3") for rs in (payload.get(table) or {}).values() for r in rs]
    kept = [r for r in rows if r.get("cut_kept")]
    excess = max((float(r.get("bottleneck_excess") or 0.0) for r in kept), default=0.0)
    return (f"{rule}, except that the cut of the table this one replaced (`{source}`) is kept while "
            f"its bottleneck stays within {KEEP_BAND:g} such windows of the best ({len(kept)} of "
            f"{len(rows)} cells kept, the largest bottleneck {excess:.1%} above the best of these "
            "costs), so a rerun does not change a cut on its calibration's noise.")


def generated_by(payload: dict[str, Any]) -> str:
    """How the page was produced: the make target only when it ran with the make target's
    arguments (--record alone), otherwise the command as run."""
    command = payload.get("command")
    if command is None or (command.get("argv") == [] and command.get("record", True)):
        return "`make throughput-table`"
    line = " ".join([command.get("prog", "gpipe-repro throughput-table"), *command["argv"]])
    return f"`{line}` (not `make throughput-table`)"


def any_busy(payload: dict[str, Any]) -> bool:
    """Whether any measured cell of a throughput payload carries a busy mark."""
    return any(BUSY_MARK in measured_note(r["measured"], normalized=True)
               for rows in payload.get("table2", {}).values() for r in rows if r.get("measured"))


def _paper_layout(rows: Sequence[dict[str, Any]]) -> str:
    ks = sorted({r["K"] for r in rows})
    ms = sorted({r["M"] for r in rows})
    by = {(r["K"], r["M"]): r for r in rows}
    body = []
    for m in ms:
        cells: list[Any] = [f"M={m}"]
        for k in ks:
            r = by.get((k, m))
            if r is None:
                cells.append("-")
                continue
            parts = [f"**{_num(r['simulated']['normalized'])}**\\*"]
            if r.get("measured") and "normalized" in r["measured"]:
                parts.append(f"measured {_num(r['measured']['normalized'])}"
                             f"{measured_note(r['measured'], normalized=True)}")
            if r.get("paper") is not None:
                parts.append(f"paper {_num(r['paper'])}")
            if r.get("torchgpipe") is not None:
                parts.append(f"torchgpipe {_num(r['torchgpipe'])}")
            cells.append("<br>".join(parts))
        body.append(cells)
    return markdown_table(["", *[f"K={k}" for k in ks]], body, align=["left"] * (len(ks) + 1))


def _detail(rows: Sequence[dict[str, Any]], flop_label: str) -> str:
    body = []
    for r in rows:
        meas = r.get("measured") or {}
        flop = r.get("flop_model") or {}
        body.append([r["K"], r["M"], r["microbatch"], r["batch"], str(r["balance"]),
                     _num(r["balance_efficiency"]), _num(r["simulated"]["throughput"], 1),
                     _num(r["simulated"]["normalized"]),
                     (_num(meas.get("throughput"), 1) + measured_note(meas)) if meas else "-",
                     (_num(meas.get("normalized")) + measured_note(meas, normalized=True))
                     if meas else "-",
                     _num(r.get("paper")), _num(r.get("torchgpipe")),
                     _num(flop.get("normalized")) if flop else "-",
                     _num(r["simulated"]["bubble_fraction"], 3), _num(r["bubble_theory"], 3)])
    headers = ["K", "M", "b", "N", "balance", "even", "sim samples/s", "sim norm.", "meas samples/s",
               "meas norm.", "paper", "torchgpipe", flop_label, "bubble (sim)",
               "(K-1)/(M+K-1)"]
    return markdown_table(headers, body, align=("right",) * 4 + ("left",) + ("right",) * 10)


def render_markdown(payload: dict[str, Any], validation: dict[str, Any] | None = None) -> str:
    """The results page of :func:`run_throughput_table` (and of the validation, if given)."""
    s = payload["settings"]
    env = payload.get("environment", {})
    link = payload["link"]
    lines = [
        "# Throughput: the GPipe paper's Tables 2 and 3",
        "",
        f"Generated by {generated_by(payload)} on {env.get('device', '?')} ({env.get('cores', '?')} "
        f"cores), torch {env.get('torch', '?')}, commit {str(env.get('git_commit'))[:10]}"
        f"{' (dirty)' if env.get('git_dirty') else ''}.",
        "",
        *([f"**{BUSY_MARK} marks a measured number taken on a busy host** (less than "
           f"{IDLE_CLEAN:.0%} of the CPU time idle in the second before the run, or other processes "
           f"using more than {OTHERS_CLEAN:.0%} of the CPU while it ran, or, for a "
           "normalized number, the same of its K=2, M=1 reference): other processes shared the cores, so "
           "it is not a clean measurement of the pipeline. Rerun `make throughput-table` on an idle "
           "host to replace it.", ""] if any_busy(payload) else []),
        *(["**The calibration ran on a busy host**"
           + busy_note(payload["host"]).replace(f" {BUSY_MARK}busy ", " ")
           + ": per-layer costs measured beside other processes, so the simulated cells may not "
           "reproduce on an idle host.", ""]
          if (payload.get("host") or {}).get("clean") is False else []),
        *([calibration_uncertainty(payload["calibration"], payload), ""]
          if any((c or {}).get("uncertainty") for c in (payload.get("calibration") or {}).values())
          else []),
        "**How to read.** Every number of ours is labelled: **bold\\*** = simulated (the pipeline "
        "simulator driven by the schedule the runtimes execute and by per-layer costs measured on "
        "this device at the micro-batch size used), *measured* = real stage processes of the "
        "distributed runtime (only where K <= usable cores). `paper` is Table 2/3 of Huang et al. "
        "(TPUs / P100s), `torchgpipe` is Kim et al.'s reproduction (8x P40). "
        "Normalized to K=2, M=1 like the paper. A measured number's [low, high] is its 95% "
        "interval (from fewer than 6 rounds: their range, followed by how often it covers the "
        "median): "
        "the measured cells run in alternating rounds, and a normalized one is the median of per-round "
        "ratios to the K=2, M=1 cell of the same round (a busy host widens the interval).",
        "",
        f"**Throughput semantics.** Micro-batch size fixed per model (policy `{s['policy']}`: "
        + ("mini-batch N = M x b, " if s["policy"] == "micro" else f"mini-batch fixed at {s['minibatch']}, ")
        + "throughput = N / step time), so the normalized number isolates pipelining: bubble, "
        "imbalance, communication, re-materialization. The paper adjusted its batch to memory and "
        "torchgpipe grows the batch with M; a fixed micro-batch is the reading under which Table 2's "
        "M=1 row stays near 1 for every K, as printed.",
        "",
        f"**Settings.** schedule `{s['schedule']}`, re-materialization `{s['checkpoint']}`, "
        f"recompute-ahead {s['recompute_ahead']}, partition objective `{s['objective']}` (exact; "
        "`even` = mean cell cost / slowest cell: 1 is perfect), costs `{}` on `{}` with {} thread(s) "
        "per stage, link `{}` (latency {:.1f} us, {:.2f} GB/s; {}).".format(
            s["method"], s["device"], s["threads"], link["name"], link["latency"] * 1e6,
            link["bandwidth"] / 1e9, link["source"]),
        "",
        "Models: " + "; ".join(f"{m}: {name}" for m, name in payload["workloads"]["table2"].items())
        + ". The FLOP-model column simulates the paper's exact models ("
        + "; ".join(payload["workloads"]["flop_model_table2"].values())
        + ") with FLOP costs on a TPUv3-core model and the TPU interconnect: deterministic, no hardware.",
        "",
        "![speedups](speedup.png)",
        "",
    ]
    for model, rows in payload["table2"].items():
        lines += [f"## Table 2, {model}", "", _paper_layout(rows), "",
                  _detail(rows, "FLOP model, paper size"), ""]
    mini = payload.get("table2_fixed_minibatch")
    if mini:
        n = mini[0]["batch"]
        lines += [f"## The other reading: a fixed mini-batch of {n} (transformer, simulated)", "",
                  f"Here N = {n} for every M, cut into micro-batches of N/M, each with costs "
                  "calibrated at that size. Small micro-batches cost more per sample on this device, "
                  "so more micro-batches buy less; this is why the main table keeps the micro-batch "
                  "size fixed.", "",
                  _paper_layout(mini), "",
                  markdown_table(["K", "M", "micro-batch", "balance", "sim samples/s", "normalized"],
                                 [[r["K"], r["M"], r["microbatch"], str(r["balance"]),
                                   _num(r["simulated"]["throughput"], 1),
                                   _num(r["simulated"]["normalized"])] for r in mini],
                                 align=["right", "right", "right", "left", "right", "right"]), ""]
    claims = payload.get("claims", [])
    if claims:
        lines += ["## Targets (simulated)", "",
                  "Each target judged on the simulated point figure (no interval: the simulator is "
                  "deterministic given the calibration, whose own uncertainty is stated at the top).", "",
                  markdown_table(["model", "K", "M", "simulated", "target", "source", "met (simulated)"],
                                 [[c["model"], c["K"], c["M"], _num(c["simulated"]), _num(c["target"]),
                                   c["target_source"], "yes" if c["met"] else "no"] for c in claims]),
                  ""]
    lines += ["## Table 3 setting: PCIe links, M=32, normalized to K=2", "",
              "Models: " + "; ".join(f"{m}: {n}" for m, n in payload["workloads"]["table3"].items())
              + ". With costs of this CPU the PCIe link is never the bottleneck (a CPU core computes "
              "~100x slower than a P100), so the FLOP-model column (paper-size models on a P100 model "
              "with PCIe) is the one that shows what the link does.", ""]
    t3 = []
    for model, rows in payload["table3"].items():
        for r in rows:
            flop = r.get("flop_model") or {}
            t3.append([model, r["K"], str(r["balance"]), _num(r["balance_efficiency"]),
                       f"{_num(r['simulated']['normalized'])}*", _num(flop.get("normalized")),
                       str(flop.get("balance", "-")), _num(r.get("paper"))])
    lines += [markdown_table(["model", "K", "balance", "even", "simulated (PCIe)",
                              "FLOP model P100 + PCIe", "FLOP-model balance", "paper"], t3,
                             align=["left", "right", "left", "right", "right", "right", "left", "right"]),
              ""]
    curves = payload.get("bubble_curves", [])
    if curves:
        ms = curves[0]["ms"]
        lines += ["## Bubble fraction against M (transformer, simulated)", "",
                  "Bubble = idle stage-time that every stage has (fill and drain), as "
                  "`Timeline.breakdown()` defines it; theory = (K-1)/(M+K-1) for balanced cells with "
                  "free links. The simulation is below theory because the breakdown counts load "
                  "imbalance and communication separately, and the optimizer step and the "
                  "re-computation of the last micro-batch fill part of the drain.", "",
                  "![bubble](bubble.png)", "",
                  markdown_table(["K", *[f"M={m}" for m in ms]],
                                 [[f"K={c['K']}", *[f"{a:.3f} ({t:.3f})" for a, t in
                                                    zip(c["simulated"], c["theory"])]]
                                  for c in curves]), "",
                  "Cells: simulated (theory).", ""]
    objectives = payload.get("objectives", {})
    if objectives:
        k, m = max(s["ks"]), max(s["ms"])
        body = [[model, o["objective"], str(o["balance"]), _num(o["balance_efficiency"]),
                 _num(o["normalized"])] for model, items in objectives.items() for o in items]
        lines += [f"## What the partitioner buys: K={k}, M={m} under each objective (simulated)", "",
                  markdown_table(["model", "objective", "balance", "even", "normalized"], body,
                                 align=["left", "left", "left", "right", "right"]), "",
                  "`bottleneck` is the engine's exact minimizer of the slowest cell; `variance` the "
                  "paper's stated objective (exact DP); `greedy` the paper's public code (lingvo: "
                  "cut where the cumulative cost crosses k/K); `equal` the same number of layers "
                  "per cell. Each cut is chosen here from this run's costs; Table 2 keeps its cut of "
                  "record where it is within the calibration's uncertainty of the best, so its "
                  "`bottleneck` figure can differ from this one by that much.", ""]
    ablation = payload.get("ablation", {})
    if ablation:
        body = [[model, a["checkpoint"], a["recompute_ahead"], _num(a["base_throughput"], 1),
                 _num(a["throughput"], 1), _num(a["normalized"])]
                for model, items in ablation.items() for a in items]
        k, m = max(s["ks"]), max(s["ms"])
        lines += [f"## Why the settings matter: K={k}, M={m} under each re-materialization setting "
                  "(simulated)",
                  "", markdown_table(["model", "checkpoint", "recompute ahead",
                                      "K=2,M=1 samples/s", f"K={k},M={m} samples/s", "normalized"],
                                     body), "",
                  "Recompute-ahead raises absolute throughput most at M=1 (the stage recomputes "
                  "while it waits for the gradient, which is all of its wait when M=1), so it "
                  "*lowers* the normalized number; `except_last` skips the recompute of the last "
                  "micro-batch, which at M=1 is the only one, so its baseline is cheaper too.", ""]
    lines += render_schedule_ablation(payload.get("schedule_ablation") or {},
                                      (payload.get("schedule_link_control") or {}).get("samples_per_s"))
    if validation:
        lines += ["## Simulator validation (simulated vs measured throughput)", "",
                  render_validation_summary(validation), ""]
    lines += ["## Where and why ours differs from the paper", ""] + differences(payload) + [""]
    cal = payload.get("calibration", {})
    if cal:
        body = [[m, c["device"], c["layers"], c["distinct_layers"],
                 ", ".join(f"b={b}: {v * 1e3:.2f} ms" for b, v in c["per_sample_s"].items())]
                for m, c in cal.items()]
        lines += ["## Calibration", "",
                  markdown_table(["model", "device", "layers", "distinct layers (timed)",
                                  "forward + backward per sample"], body,
                                 align=["left"] * 5), ""]
    if payload.get("gantt"):
        lines += ["## Gantt charts", "", f"{payload['gantt']['caption']}", "",
                  f"![gantt]({payload['gantt']['file']})", ""]
    if payload.get("gantt_measured"):
        lines += [f"Measured, transformer {payload['gantt_measured']['config'].replace('_', ', ')} "
                  "(the distributed runtime's own timeline):", "",
                  f"![measured gantt]({payload['gantt_measured']['file']})", ""]
    return "\n".join(lines)


def differences(payload: dict[str, Any]) -> list[str]:
    """Bullet points comparing our cells with the paper's, worded from the rows themselves."""
    out = []
    for model, rows in payload["table2"].items():
        by = {(r["K"], r["M"]): r for r in rows}
        for (k, m) in ((8, 1), (8, 4), (8, 32)):
            r = by.get((k, m))
            if r is None or r.get("paper") is None:
                continue
            ours, theirs = r["simulated"]["normalized"], r["paper"]
            bound = m * k / (m + k - 1)
            head = f"- **{model}, K={k}, M={m}**: ours {_num(ours)}, paper {_num(theirs)}"
            if r.get("torchgpipe") is not None:
                head += f", torchgpipe {_num(r['torchgpipe'])}"
            head += (f" (fill-drain figure MK/(M+K-1) = {bound:.2f} at a fixed micro-batch, before "
                     "the once-per-step costs that more micro-batches amortize). ")
            if theirs > bound:
                why = ("The paper is above what any fill-drain pipeline can reach at a fixed "
                       "micro-batch size, so its larger K ran larger batches (its caption: batch "
                       "\"adjusted to fit memory\"); with one micro-batch nothing overlaps, so our "
                       "M=1 row stays at 1." if m == 1 else
                       "The paper is above the fill-drain bound at a fixed micro-batch size: its "
                       "larger K also ran larger batches (\"adjusted to fit memory\"), which our "
                       "fixed-micro-batch reading excludes on purpose.")
            elif ours >= theirs:
                why = (f"Ours is higher: the exact bottleneck partitioner balances measured costs "
                       f"(partition {r['balance']}, even {_num(r['balance_efficiency'])}), our "
                       "micro-batches keep their size as M grows (on a TPU, N/M-sized micro-batches "
                       "underuse the device), the once-per-step costs (optimizer step, BatchNorm "
                       "commit) are spread over M micro-batches, and the link is cheap next to a CPU "
                       "core's compute.")
            else:
                why = (f"Ours is lower: partition {r['balance']} (even "
                       f"{_num(r['balance_efficiency'])}), plus re-materialization and the "
                       "runtime's per-step costs, which the paper's TPU setting hides better.")
            out.append(head + why)
    out.append("- **Hardware.** Our devices are CPU cores (1 thread each) linked by gloo over "
               "loopback; K > usable cores is simulated only. Per-sample costs and the "
               "compute-to-communication ratio differ from TPUs; the FLOP-model column shows the "
               "paper's exact models on a model of the paper's devices instead (optimistic for "
               "memory-bound layers such as AmoebaNet's pooling and BatchNorm).")
    return out


def render_validation_summary(validation: dict[str, Any]) -> str:
    """The validation's verdict, per schedule, and a row per configuration with its error interval."""
    from gpipe_repro.repro.throughput.simulator_error import describe

    rows = validation["rows"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:+.1f}%"

    def error(r: dict[str, Any]) -> str:
        if "error" not in r:           # a validation written before errors had intervals
            return pct(r["relative_error"])
        return Figure.from_json(r["error"]).percent_cell(missing="-")

    def schedule(r: dict[str, Any]) -> str:
        name, split = r.get("schedule", "gpipe"), r.get("split_backwards")
        return name if split is None else f"{name} (split {split} of {r['M']})"

    body = [[r["model"], r["K"], r["M"], r["checkpoint"], schedule(r),
             _num(r["measured_throughput"], 2), _num(r["simulated_throughput"], 2), error(r),
             pct(r.get("replay_error")),
             "-" if r.get("host_fast") is None else f"{r['host_fast']:.0%}"] for r in rows]
    summary = validation["summary"]
    head = (describe(summary) if "verdict" in summary else
            f"Median |error| {summary['median_abs_error'] * 100:.1f}%, worst "
            f"{summary['max_abs_error'] * 100:.1f}% over {len(rows)} configurations.")
    rounds = max((r.get("measured_rounds") or 1 for r in rows), default=1)
    head += (" Each error is the median over the measured steps with its 95% interval (fewer than 6 "
             "steps: their range, with its coverage; the steps of one round share the host's state, "
             "so an interval is a lower bound of the uncertainty)"
             + (f" (every configuration measured in {rounds} rounds, the rounds interleaved across "
                "configurations and each model's costs calibrated again in every round right before "
                "its configurations; each round's steps against the simulation from that round's "
                "costs, paired, as the host's speed drifts over minutes)"
                if rounds > 1 else "")
             + "; the bounds of the median and the worst come from the intervals' ends, so a busy "
             "host widens them and can leave the verdict inconclusive.")
    if summary.get("last_round_configurations") is not None:
        head += (f" {summary['rounds']} of the {summary['rounds_asked']} rounds asked for, and "
                 f"{summary['last_round_configurations']} of the {len(rows)} configurations of one "
                 f"more (with a run more each) before the next would have ended past the "
                 f"{summary['budget_s']:g} s budget.")
    elif (summary.get("rounds_asked") or 0) > (summary.get("rounds") or 0) > 0:
        head += (f" {summary['rounds']} of the {summary['rounds_asked']} rounds asked for: another "
                 f"would not have ended within the {summary['budget_s']:g} s budget.")
    unpaired = summary.get("unpaired")
    if rounds > 1 and unpaired and unpaired.get("configurations"):
        head += (" Unpaired (all the steps against the simulation from the median of the rounds' "
                 f"costs; the samples/s columns): {describe(unpaired)}.")
    leveled = summary.get("leveled")
    if leveled and leveled.get("configurations"):
        factors = summary.get("level_factors") or {}
        shown = "; ".join(
            f"{model} " + ", ".join("/".join(f"{f[kind]:.2f}" for kind in ("forward", "backward"))
                                    for f in per_round)
            for model, per_round in factors.items() if per_round)
        head += (" Leveled in situ (each calibration scaled, per action kind, by a short run of the "
                 "model on the real stage processes right after it: its gpipe cut, 3 steps of 4 "
                 "micro-batches, re-materialized; `sim/in_situ.py`, `level_factors`; paired per round "
                 "as the first line): it models what a stage process pays that the calibrating "
                 "process does not (the host's speed at run time, the stage's caches and allocator, "
                 "the executor's own work), for every layer alike, and leaves the schedule's "
                 f"bubbles, transfers and accumulation to the simulator: {describe(leveled)}; it "
                 f"moved the median |error| from {summary['median_abs_error']:.1%} to "
                 f"{leveled['median_abs_error']:.1%} and the worst from {summary['max_abs_error']:.1%} "
                 f"to {leveled['max_abs_error']:.1%}"
                 + (f"; factors forward/backward per round: {shown}" if shown else "") + ".")
    state = summary.get("by_host_fast")
    if state:
        head += (" The errors go with the host's state during the runs (the speed probe's share of "
                 f"fast readings around each run; correlation {state['correlation']:+.2f}): the "
                 f"configurations run with the host fast less than {state['fast_share_split']:.0%} of "
                 f"the time err by a median of {pct(state['median_error_slower'])}, the others "
                 f"{pct(state['median_error_faster'])}"
                 + (f"; the host was fast {summary['host_fast']:.0%} of the time around the runs and "
                    f"{summary['host_fast_calibrating']:.0%} around the calibrations"
                    if summary.get("host_fast_calibrating") is not None
                    and summary.get("host_fast") is not None else "") + ".")
    if summary.get("exact_median_abs_error") is not None:
        head += (" The simulation draws every compute action's duration as this host's durations "
                 "vary (sim/jitter: each core switches between a fast and a 2x slower state every "
                 "few milliseconds, and a pipeline waits for the later of two actions) and takes "
                 "the median of its simulated steps; with every action at its calibrated cost "
                 f"instead, median |error| {summary['exact_median_abs_error'] * 100:.1f}%, worst "
                 f"{summary['exact_max_abs_error'] * 100:.1f}% (by the medians).")
    if summary.get("replay_median_abs_error") is not None:
        head += (f" Replaying each measured step's own action durations through the simulator "
                 f"(pipeline model alone, cost model excluded): median "
                 f"{summary['replay_median_abs_error'] * 100:.1f}%, worst "
                 f"{summary['replay_max_abs_error'] * 100:.1f}%.")
    per = summary.get("per_schedule") or {}
    if len(per) > 1:
        head += " Per schedule: " + "; ".join(
            f"`{name}` {describe(p)}" if "verdict" in p else f"`{name}` median "
            f"{p['median_abs_error'] * 100:.1f}%" for name, p in per.items()) + "."
    for name, why in (summary.get("not_validated") or {}).items():
        head += f" `{name}` is not validated: {why}."
    page = head + "\n\n" + markdown_table(
        ["model", "K", "M", "checkpoint", "schedule", "measured samples/s", "simulated samples/s",
         "error [95% interval]", "replay error", "host fast"], body)
    versus = summary.get("zero_bubble") or []
    if versus:
        figures = [Figure.from_json(v["ratio"]) for v in versus]
        met = sum(f.verdict == "met" for f in figures)
        page += ("\n\nZero bubble against 1F1B, measured in the same rounds (1F1B's step time over the "
                 "zero-bubble schedule's, step by step within each round; above 1 where zero bubble "
                 "is faster; each schedule on its own cut, a zero-bubble one with the cut and the "
                 "count of split backwards, the last micro-batches', whose simulated step from the "
                 "calibration is shortest: sim/split_choice). Target: lower bound >= 1.00 on every "
                 f"row; met on {met} of {len(figures)}. These are the validation's few pairs; the "
                 "same comparison on every model of both validations, one step of each schedule "
                 "per round for tens of rounds, is `make bench-zero-bubble` "
                 "([zero_bubble.md](../schedules/zero_bubble.md)).\n\n" + markdown_table(
                     ["model", "K", "checkpoint", "M", "schedule", "split", "cut", "1f1b's cut",
                      "1f1b / zero bubble [95%]", "pairs"],
                     [[v["model"], v.get("K", "-"), v["checkpoint"], v["M"], v["schedule"],
                       "all" if v.get("split_backwards") is None else v["split_backwards"],
                       v["balance"], v["balance_1f1b"], f.cell(), f.rounds]
                      for v, f in zip(versus, figures)]))
    return page

