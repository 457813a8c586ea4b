"""The demo's report: a summary table and an HTML page with an SVG plot of per-rank compute."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from slurm_plugin.demo.run import DemoRun

_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
W, H, PAD = 900, 360, 50


def _svg(run: DemoRun, summary: dict[str, Any]) -> str:
    if not run.records:
        return "<p>no telemetry</p>"
    t0 = run.started
    xs = [r.ts - t0 for r in run.records]
    ys = [(r.compute_s or 0.0) * 1000 for r in run.records]
    x_max, y_max = max(xs) or 1.0, (max(ys) or 1.0) * 1.1

    def px(x: float) -> float:
        return PAD + (W - 2 * PAD) * x / x_max

    def py(y: float) -> float:
        return H - PAD - (H - 2 * PAD) * y / y_max

    parts = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
            'font-family="sans-serif" font-size="12">'
        ),
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#333"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="#333"/>',
        f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">seconds since submit</text>',
        (
            f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" '
            'text-anchor="middle">compute per step (ms)</text>'
        ),
    ]
    for tick in range(6):
        y = y_max * tick / 5
        parts.append(f'<text x="{PAD - 6}" y="{py(y) + 4:.0f}" text-anchor="end">{y:.0f}</text>')
        x = x_max * tick / 5
        parts.append(
            f'<text x="{px(x):.0f}" y="{H - PAD + 16}" text-anchor="middle">{x:.0f}</text>'
        )
    by_rank: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for r, x, y in zip(run.records, xs, ys, strict=True):
        by_rank.setdefault((r.rank, r.attempt), []).append((x, y))
    for (rank, attempt), points in sorted(by_rank.items()):
        points.sort()
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        node = next((r.node for r in run.records if r.rank == rank and r.attempt == attempt), "")
        parts.append(
            f'<polyline fill="none" stroke="{_COLORS[rank % len(_COLORS)]}" '
            f'stroke-width="1" points="{path}"><title>rank {rank} on {node} '
            f"(run {attempt})</title></polyline>"
        )
    marks = [("onset", run.onset_ts, "#d62728")]
    detection = next((d for d in run.decisions if d.get("node") == "node3"), None)
    if detection:
        marks.append(("detection", float(detection["detected_ts"]), "#9467bd"))
    eviction = next((d for d in run.decisions if d.get("held_ts")), None)
    if eviction:
        marks.append(("eviction", float(eviction["held_ts"]), "#000"))
    for label, ts, color in marks:
        if ts is None:
            continue
        x = px(ts - t0)
        parts.append(
            f'<line x1="{x:.1f}" y1="{PAD}" x2="{x:.1f}" y2="{H - PAD}" '
            f'stroke="{color}" stroke-dasharray="4 3"/>'
        )
        parts.append(f'<text x="{x + 3:.1f}" y="{PAD + 12}" fill="{color}">{label}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def write_report(
    path: Path, runs: list[tuple[DemoRun, dict[str, Any]]], ratio: float | None
) -> None:
    """One HTML page: the figures of each run and the plot of the first."""
    sections = []
    for run, summary in runs:
        rows = "".join(
            f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(json.dumps(v))}</td></tr>"
            for k, v in summary.items()
            if k != "decisions"
        )
        decisions = html.escape(json.dumps(summary["decisions"], indent=1))
        sections.append(
            f"<h2>policy {html.escape(run.policy)} — job {run.job_id}</h2>"
            f"{_svg(run, summary)}<table>{rows}</table><pre>{decisions}</pre>"
        )
    if runs:
        path.with_name("plot.svg").write_text(_svg(*runs[0]))
    goodput = f"<p><b>Total job time with eviction / without: {ratio:.2f}</b></p>" if ratio else ""
    path.write_text(
        "<!doctype html><meta charset='utf-8'><title>slurm-straggler demo</title>"
        "<style>body{font-family:sans-serif;max-width:960px;margin:2em auto}"
        "td{padding:2px 8px;border-bottom:1px solid #ddd}</style>"
        "<h1>slurm-straggler demo</h1>" + goodput + "".join(sections)
    )
