"""The demo report's figures, drawn with matplotlib (the ``demo`` extra) as inline SVG: a heatmap
of each rank's compute time against its peers over time, and a timeline of each decision's
states."""

from __future__ import annotations

import io
import math
from collections import defaultdict
from typing import Any

import matplotlib as mpl

mpl.use("Agg")  # no display: files only
import matplotlib.pyplot as plt
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from slurm_plugin.demo.run import SLOW_NODE, DemoRun

#: Columns of the heatmap: the run's duration is cut into this many time bins.
_BINS = 160
#: Colour scale of compute time / the step's median across ranks: 1x (as fast as the peers)
#: to 16x and beyond.
_RATIO_MAX = 16.0
_NO_STEPS = "#e8e8e8"
MARKS = {"onset": "#d62728", "detection": "#9467bd", "requeue": "#000000"}
STATE_COLORS = {
    "waiting": "#fdd49e",
    "planned": "#fdbb84",
    "held": "#fc8d59",
    "excluded": "#ef6548",
    "released": "#d7301f",
    "verified": "#2ca02c",
    "recorded": "#1f77b4",
    "failed": "#7f7f7f",
    "abandoned": "#bcbcbc",
}


def event_times(run: DemoRun) -> dict[str, float]:
    """Seconds since submit of the onset, the first detection of node3 and the requeue."""
    out: dict[str, float] = {}
    if run.onset_ts is not None:
        out["onset"] = run.onset_ts - run.started
    detected = [
        float(d["detected_ts"])
        for d in run.decisions
        if d.get("detected_ts") and d.get("node") == SLOW_NODE
    ]
    if detected:
        out["detection"] = min(detected) - run.started
    held = [float(d["held_ts"]) for d in run.decisions if d.get("held_ts")]
    if held:
        out["requeue"] = min(held) - run.started
    return out


def compute_ratios(run: DemoRun) -> list[tuple[int, str, float, float]]:
    """(rank, node, seconds since submit, compute / the median of all ranks at that step and
    attempt) for every record with a compute time."""
    by_step: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in run.records:
        if r.compute_s is not None:
            by_step[(r.attempt, r.step)].append(r.compute_s)
    medians = {key: sorted(v)[len(v) // 2] for key, v in by_step.items()}
    out = []
    for r in run.records:
        median = medians.get((r.attempt, r.step))
        if r.compute_s is None or not median:
            continue
        out.append((r.rank, r.node, r.ts - run.started, r.compute_s / median))
    return out


def _svg(fig: Figure) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # inline: without the XML prolog and doctype


def heatmap_svg(run: DemoRun) -> str:
    """Per rank (rows) and time (columns): the rank's compute time over the median of all
    ranks at the same step, on a log colour scale; grey where no step was reported (start-up,
    the requeue). Onset, detection and requeue are vertical lines with a legend."""
    points = compute_ratios(run)
    fig, ax = plt.subplots(figsize=(9.0, 3.4), dpi=100)
    if not points:
        ax.text(0.5, 0.5, "no telemetry", ha="center", va="center", transform=ax.transAxes)
        return _svg(fig)
    ranks = sorted({p[0] for p in points})
    end = max(run.total_s, *(p[2] for p in points)) or 1.0
    width = end / _BINS
    sums = [[0.0] * _BINS for _ in ranks]
    counts = [[0] * _BINS for _ in ranks]
    row = {rank: i for i, rank in enumerate(ranks)}
    nodes: dict[int, list[str]] = defaultdict(list)
    for rank, node, t, ratio in sorted(points, key=lambda p: p[2]):
        col = min(_BINS - 1, max(0, int(t / width)))
        sums[row[rank]][col] += math.log(ratio)
        counts[row[rank]][col] += 1
        if node not in nodes[rank]:
            nodes[rank].append(node)
    grid = [
        [math.exp(s / c) if c else math.nan for s, c in zip(srow, crow, strict=True)]
        for srow, crow in zip(sums, counts, strict=True)
    ]
    cmap = mpl.colormaps["magma_r"].with_extremes(bad=_NO_STEPS)
    image = ax.imshow(
        grid,
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        norm=LogNorm(vmin=1.0, vmax=_RATIO_MAX, clip=True),
        extent=(0.0, end, len(ranks) - 0.5, -0.5),
    )
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r} · {' → '.join(nodes[r])}" for r in ranks], fontsize=8)
    ax.set_xlabel("seconds since the job was submitted")
    bar = fig.colorbar(image, ax=ax, pad=0.01, extend="max")
    bar.set_ticks([1, 2, 4, 8, 16], labels=["1x", "2x", "4x", "8x", "16x"])
    bar.set_label("compute time / the step's median", fontsize=8)
    handles: list[Any] = []
    for label, t in event_times(run).items():
        ax.axvline(t, color=MARKS[label], linestyle="--" if label != "requeue" else "-", lw=1.4)
        handles.append(Line2D([], [], color=MARKS[label], lw=1.4, label=f"{label} ({t:.0f} s)"))
    handles.append(Patch(color=_NO_STEPS, label="no steps reported"))
    ax.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.01),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
    )
    return _svg(fig)


def state_changes(run: DemoRun) -> dict[str, list[tuple[str, float]]]:
    """Each decision's states in order, with the time (seconds since submit) it entered them,
    from the audit trail (every state change is an audit entry)."""
    out: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for entry in run.audit:
        state, ts = entry.get("state"), entry.get("updated_at")
        if not state or not ts or not entry.get("id"):
            continue
        changes = out[entry["id"]]
        if not changes or changes[-1][0] != state:
            changes.append((state, float(ts) - run.started))
    return dict(out)


def timeline_svg(run: DemoRun) -> str:
    """One row per decision: a bar per state, from when the decision entered it to the next
    state (a final state gets a short bar), coloured by state, with a legend."""
    changes = state_changes(run)
    decisions = {d["id"]: d for d in run.decisions}
    rows = [i for i in changes if i in decisions] or list(changes)
    fig, ax = plt.subplots(figsize=(9.0, 0.55 * max(1, len(rows)) + 1.1), dpi=100)
    if not rows:
        ax.text(0.5, 0.5, "no decisions", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return _svg(fig)
    end = max(run.total_s, *(t for c in changes.values() for _, t in c))
    seen: dict[str, None] = {}
    for y, decision_id in enumerate(rows):
        steps = changes[decision_id]
        for i, (state, start) in enumerate(steps):
            stop = steps[i + 1][1] if i + 1 < len(steps) else start + end / 80
            ax.broken_barh(
                [(start, max(stop - start, end / 400))],
                (y - 0.35, 0.7),
                color=STATE_COLORS.get(state, "#cccccc"),
            )
            seen[state] = None
    ax.set_yticks(range(len(rows)))
    labels = []
    for decision_id in rows:
        d = decisions.get(decision_id, {})
        where = d.get("node") or (d.get("kind") or "job-wide").replace("_", " ")
        labels.append(f"{decision_id} · {where} · {d.get('action') or d.get('decision') or '?'}")
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.02)
    ax.set_xlabel("seconds since the job was submitted")
    ax.legend(
        handles=[Patch(color=STATE_COLORS.get(s, "#cccccc"), label=s) for s in seen],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.01),
        ncol=max(1, len(seen)),
        fontsize=8,
        frameon=False,
    )
    return _svg(fig)
