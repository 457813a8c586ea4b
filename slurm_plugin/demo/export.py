"""A demo run as a trace the backtest replays: the job's first run (until its requeue, or to
its end) with its companions, and what the run knows that a trace does not (``TRACE.truth.json``:
the node slowed, when, and what the service did about it).

``straggler backtest demo-report/evict/trace.csv`` then answers what the service would have
decided on this run's telemetry; the unit tier replays runs kept this way
(``tests/data/runs/``) against their truth.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slurm_plugin.demo.run import SLOW_NODE, DemoRun
from slurm_plugin.model.records import sort_records
from slurm_plugin.store import decision as decision_record
from slurm_plugin.trace import write_trace
from slurm_plugin.trace_meta import JobFacts, companion, write_events, write_jobs

#: What of a run's summary the truth keeps.
TRUTH_FIELDS = (
    "policy",
    "recovery",
    "job_id",
    "onset_step",
    "detection_step",
    "onset_to_requeue_s",
    "onset_to_advice_s",
    "restarts",
    "excluded",
)


def time_limit_s(text: str) -> float | None:
    """Slurm's ``TimeLimit`` (``[D-]HH:MM:SS``) in seconds; None: ``UNLIMITED``, or anything
    else."""
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts) or not (days.isdigit() or not days):
        return None
    hours, minutes, seconds = (int(p) for p in parts)
    return float(86400 * int(days or 0) + 3600 * hours + 60 * minutes + seconds)


def write_run(run: DemoRun, summary: dict[str, Any], path: Path) -> int:
    """Write the run's first attempt as ``path`` (trace CSV), its start and time limit
    (``.jobs.csv``: the start is the submission, a second or so early), its events up to the
    requeue (``.events.csv``) and its truth (``.truth.json``); returns the records written."""
    first = sort_records(r for r in run.records if r.attempt == 0)
    if not first:
        return 0
    end = max(r.ts for r in first)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        rows = write_trace(first, out)
    limit = time_limit_s(run.job.get("TimeLimit", ""))
    facts = JobFacts(run.started, run.started + limit if limit is not None else None)
    with companion(path, "jobs").open("w") as out:
        write_jobs([(run.job_id, facts)], out)
    with companion(path, "events").open("w") as out:
        write_events(((run.job_id, ts, name) for ts, name in run.events if ts <= end), out)
    truth = {key: summary.get(key) for key in TRUTH_FIELDS}
    truth |= {
        "slow_node": SLOW_NODE,
        "onset_ts": run.onset_ts,
        "first_ts": min(r.ts for r in first),
        "last_ts": end,
        "nodes": sorted({r.node for r in first}),
        "ranks": len({r.rank for r in first}),
    }
    # What the live service decided on this run, in order: the replay is held to it.
    records = [decision_record.read(d) for d in run.decisions]
    truth["decisions"] = [
        {"kind": d.kind, "node": d.node, "action": d.action, "step": d.step}
        for d in records
        if d.detected_ts is not None and d.detected_ts <= end
    ]
    evictions = [d for d in records if d.action == "evict"]
    if evictions:
        truth["requeue_ts"] = evictions[0].held_ts
        truth["evicted_nodes"] = sorted(evictions[0].nodes or [evictions[0].node or ""])
    companion(path, "truth").with_suffix(".json").write_text(json.dumps(truth, indent=2) + "\n")
    return rows
