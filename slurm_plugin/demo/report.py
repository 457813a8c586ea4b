"""The demo's report: an HTML page (jinja2) with the headline an admin asks for (time and
rank-hours lost to the straggler, with and without eviction), per-run figures in words, a
heatmap of each rank's compute against its peers, each decision's states over time and its
reasons; the raw JSON only in a collapsible detail. Needs the ``demo`` extra."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jinja2

from slurm_plugin.demo.figures import heatmap_svg, timeline_svg
from slurm_plugin.demo.run import SLOW_NODE, DemoRun

_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("slurm_plugin.demo", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)
NONE = "\N{EN DASH}"  # a missing figure


def _num(value: Any, fmt: str = "{:g}", unit: str = "") -> str:
    """A figure for a table: an en dash for a missing or non-finite one, never None or NaN."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return NONE
    return fmt.format(value) + (f" {unit}" if unit else "")


def _reasons(raw: str | None) -> list[str]:
    """A decision's reasons as sentences (stored as a JSON list)."""
    if not raw:
        return []
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return [raw]
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def _figures(s: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The run's figures as (label, value, what it means)."""
    delay = s.get("detection_delay_steps")
    detected = (
        f"{delay} steps" if delay is not None else NONE,
        (
            f"{_num(s.get('detection_delay_s'), unit='s')} after the onset at step "
            f"{_num(s.get('onset_step'))}"
        ),
    )
    return [
        ("Job", f"{s.get('state') or NONE}", f"{s.get('restarts', 0)} restart(s)"),
        ("Job time", _num(s.get("total_s"), "{:.1f}", "s"), "submit to completion"),
        ("Detected", *detected),
        (
            "Onset to requeue",
            _num(s.get("onset_to_requeue_s"), "{:.1f}", "s"),
            "the job requeued without the straggler" if s.get("excluded") else "not requeued",
        ),
        (
            "Onset to a healthy step",
            _num(s.get("onset_to_healthy_s"), "{:.1f}", "s"),
            "the job's step time back within 10 % of its own before the onset",
        ),
        (
            "Pace",
            (
                f"{_num(s.get('steps_per_s_before'), '{:.1f}')} → "
                f"{_num(s.get('steps_per_s_during'), '{:.1f}')} → "
                f"{_num(s.get('steps_per_s_after'), '{:.1f}')}"
            ),
            "steps per second: before the onset, while slow, after the requeue",
        ),
        (
            "Resumed from step",
            _num(s.get("resumed_from_step")),
            f"{s['work_lost_steps']} step(s) done twice"
            if s.get("work_lost_steps") is not None
            else "not restarted",
        ),
        (
            "Lost to the straggler",
            _num(s.get("lost_to_straggler_s"), "{:.1f}", "s"),
            f"{_num(s.get('rank_hours_lost'), '{:.3f}')} rank-hours over {s.get('ranks', 0)} ranks",
        ),
        (
            "Nodes at the end",
            ", ".join(s.get("final_nodes") or []) or NONE,
            f"excluded: {s.get('excluded') or 'none'}",
        ),
    ]


def _story(run: DemoRun, s: dict[str, Any]) -> str:
    if run.policy == "observe":
        return (
            f"Under observe the service records what it finds and changes nothing: "
            f"{SLOW_NODE} stays slow until the job ends."
        )
    if s.get("excluded"):
        evicted: dict[str, Any] = next(
            (d for d in s.get("decisions") or [] if d.get("action") == "evict"), {}
        )
        waited = ""
        if evicted.get("lasted_s") is not None and evicted.get("lasting_p") is not None:
            waited = (
                f" once the slowdown had lasted {float(evicted['lasted_s']):.0f} s "
                f"({float(evicted['lasting_p']):.0%} likely to last, not a passing burst)"
            )
        return (
            f"The service detected {SLOW_NODE}, decided to evict{waited}, requeued the job "
            f"at its next checkpoint without {SLOW_NODE}, and the job resumed from step "
            f"{_num(s.get('resumed_from_step'))} on {', '.join(s.get('final_nodes') or [])}."
        )
    return f"The job was not requeued under {run.policy}."


def headline(summaries: list[dict[str, Any]]) -> str:
    """One sentence: what eviction changed, in time and rank-hours."""
    evicted = next((s for s in summaries if s.get("excluded")), summaries[0] if summaries else {})
    observed = next((s for s in summaries if s.get("policy") == "observe"), None)
    lost = evicted.get("lost_to_straggler_s")
    if observed is None or not evicted.get("total_s") or not observed.get("total_s"):
        return (
            f"Policy {evicted.get('policy', '?')}: the job took "
            f"{_num(evicted.get('total_s'), '{:.0f}', 's')}; the straggler cost "
            f"{_num(lost, '{:.0f}', 's')}."
        )
    less = 1 - evicted["total_s"] / observed["total_s"]
    saved = None
    if lost is not None and observed.get("lost_to_straggler_s") is not None:
        saved = (observed["lost_to_straggler_s"] - lost) * int(observed.get("ranks") or 0) / 3600
    return (
        f"Evicting {SLOW_NODE} finished the job in {evicted['total_s']:.0f} s instead of "
        f"{observed['total_s']:.0f} s ({less:.0%} less time): the straggler cost "
        f"{_num(lost, '{:.0f}', 's')} instead of "
        f"{_num(observed.get('lost_to_straggler_s'), '{:.0f}', 's')}"
        + (f", {saved:.3f} rank-hours saved." if saved is not None and saved > 0 else ".")
    )


def render(runs: list[tuple[DemoRun, dict[str, Any]]]) -> str:
    """The report page."""
    summaries = [s for _, s in runs]
    pages = []
    for run, s in runs:
        pages.append(
            {
                "policy": run.policy,
                "job_id": run.job_id,
                "story": _story(run, s),
                "heatmap": heatmap_svg(run),
                "timeline": timeline_svg(run),
                "figures": _figures(s),
                "decisions": [
                    {
                        "id": d.get("id", NONE),
                        "node": d.get("node") or "job-wide",
                        "verdict": d.get("action") or d.get("decision") or NONE,
                        "state": d.get("state") or NONE,
                        "reasons": _reasons(d.get("reasons"))
                        or [f"{(d.get('kind') or 'event').replace('_', ' ')} reported"],
                    }
                    for d in run.decisions
                ],
                "raw": json.dumps(s, indent=1, default=str),
            }
        )
    comparison = [
        {
            "policy": s.get("policy"),
            "total": _num(s.get("total_s"), "{:.1f}", "s"),
            "lost": _num(s.get("lost_to_straggler_s"), "{:.1f}", "s"),
            "rank_hours": _num(s.get("rank_hours_lost"), "{:.3f}"),
            "restarts": s.get("restarts", 0),
        }
        for s in summaries
    ]
    template = _TEMPLATES.get_template("report.html.j2")
    return template.render(
        headline=headline(summaries),
        comparison=comparison if len(summaries) > 1 else [],
        runs=pages,
        slow_node=SLOW_NODE,
    )


def write_report(path: Path, runs: list[tuple[DemoRun, dict[str, Any]]]) -> None:
    """report.html, and plot.svg beside it (the first run's heatmap, for the README)."""
    path.write_text(render(runs))
    if runs:
        path.with_name("plot.svg").write_text(heatmap_svg(runs[0][0]))
