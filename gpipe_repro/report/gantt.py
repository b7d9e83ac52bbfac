"""Gantt chart of a :class:`~gpipe_repro.engine.timeline.Timeline` as a PNG: one row per stage, one bar per
action, so fill, drain, recomputation and waiting can be seen at a glance.

It takes only a Timeline and a path, so a measured run (the distributed runtime), a local run and a
simulation are drawn the same way. Receives are split at ``ready`` when it is known: the part before
the matching send started is waiting (hatched), the rest is moving bytes. The title line carries the
paper's breakdown categories. Matplotlib is used through its object API with the Agg canvas, so
drawing never touches pyplot's global state or needs a display.
"""
from __future__ import annotations

from pathlib import Path

from gpipe_repro.engine.timeline import Timeline

COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "backward_input": "#E8A77A",
          "backward_weight": "#B5651D", "recompute": "#8172B3",
          "optimizer_step": "#55A868", "send": "#937860", "transfer": "#C44E52", "wait": "#DDDDDD",
          "agree": "#2F2F2F", "allreduce": "#64B5CD"}
LABELS = {"forward": "forward", "backward": "backward", "backward_input": "backward, input gradient (I)",
          "backward_weight": "backward, weight gradient (W)", "recompute": "re-computation",
          "optimizer_step": "optimizer update", "send": "send", "transfer": "receive (data moving)",
          "wait": "receive (waiting for the sender)", "agree": "agree (all stages, before the update)",
          "allreduce": "gradient all-reduce over replicas (launch to completion)"}
_LETTER = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W",
           "recompute": "R", "optimizer_step": "U", "agree": "A",
           "allreduce": "AR"}


def _bars(timeline: Timeline) -> list[tuple[int, str, float, float, str]]:
    """(stage, style, start, width, text) for every drawable piece of every event."""
    out = []
    for e in timeline.events:
        if e.kind.startswith("recv"):
            split = e.start if e.ready is None else min(max(e.start, e.ready), e.end)
            if e.ready is not None and split > e.start:
                out.append((e.stage, "wait", e.start, split - e.start, ""))
            out.append((e.stage, "transfer", split, e.end - split, ""))
        elif e.kind.startswith("send"):
            out.append((e.stage, "send", e.start, e.duration, ""))
        elif e.kind in COLORS:
            mb = "" if e.microbatch is None else str(e.microbatch)
            out.append((e.stage, e.kind, e.start, e.duration, _LETTER[e.kind] + mb))
    return out


def render_gantt(timeline: Timeline, path: str | Path, title: str | None = None, *,
                 written_by: str | None = None) -> Path:
    """Draw `timeline` and write it to `path` as a PNG (atomically). Returns the path.

    `written_by` (a command name) is stored in the PNG as a text chunk, so that the command can
    later tell its own chart from a user's file (:func:`gpipe_repro.report.output_guard.written_by`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from gpipe_repro.report.output_guard import OWNER_KEY
    from gpipe_repro.report.records import atomic_write

    k = timeline.num_stages
    span = timeline.makespan or 1.0
    scale, unit = (1e3, "ms") if span < 10 else (1.0, "s")
    fig = Figure(figsize=(14, 1.4 + 0.6 * k), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    used: set[str] = set()
    for stage, style, start, width, text in _bars(timeline):
        if width <= 0:
            continue
        used.add(style)
        ax.broken_barh([(start * scale, width * scale)], (stage - 0.4, 0.8), facecolors=COLORS[style],
                       edgecolor="white" if style != "wait" else "#999999", linewidth=0.4,
                       hatch="///" if style == "wait" else None)
        if text and width / span > 0.018:
            ax.text((start + width / 2) * scale, stage, text, ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_ylim(k - 0.5, -0.5)  # stage 0 on top
    per = int(timeline.meta.get("stages") or k)   # replicas: one row per rank = replica * K + stage
    ax.set_yticks(range(k), [f"stage {s}" if per == k else f"r{s // per} stage {s % per}"
                             for s in range(k)])
    ax.set_xlim(0, span * scale)
    ax.set_xlabel(f"time ({unit})")
    shares = timeline.breakdown()
    summary = ", ".join(f"{name} {share:.1%}" for name, share in shares.items() if share >= 0.0005)
    ax.set_title((title + "\n" if title else "") + summary, fontsize=9)
    handles = [Patch(facecolor=COLORS[s], hatch="///" if s == "wait" else None, label=LABELS[s])
               for s in COLORS if s in used]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.005, 0.5), fontsize=8,
              frameon=False)
    fig.tight_layout()
    path = Path(path)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png",
                    metadata=None if written_by is None else {OWNER_KEY: written_by})
    return path
