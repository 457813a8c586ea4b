"""Scoring backtest decisions against a cluster month's ground truth (GPU-hours).

An eviction of node N from job J at time t is **justified** when N truly had a sustained fault
in J at t (a persistent fault or a fail-slow episode of at least ``SUSTAINED_S``); anything
else (a healthy node, structure, a burst, an input-bound rank) is **needless**. Its net saving
is the job's loss to that fault from t to the fault's (or the job's) end, less the restart
and the work since the job's last checkpoint, all times the job's GPUs. The **oracle** evicts
each fault at the best moment it could know of (its onset, or one of the job's checkpoints
while it lasts) when that pays, and never otherwise. Faults that slow every rank of a job (a
whole node of a one-node job) are left out of all three: no timing can tell them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.scenarios.cluster import JobTruth, Month, Slowdown

#: A fault must be visible this long in the trace to count as missed when nothing saw it.
VISIBLE_S = 300.0
#: ... and waste at least this share of the job's time (a slowdown of the job, not a rank).
MISSED_MIN_LOSS = 0.05


@dataclass
class Score:
    """One policy's month."""

    evictions: int = 0
    needless: int = 0
    not_paying: int = 0
    wrong_persistent: list[str] = field(default_factory=list)
    bad_persistent: int = 0
    #: Bad nodes (a fault of their own) slow in two or more jobs of the month, never marked
    #: persistent.
    bad_unmarked: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    lost_gpu_h: float = 0.0
    spent_gpu_h: float = 0.0
    saved_gpu_h: float = 0.0
    needless_list: list[str] = field(default_factory=list)

    @property
    def net_gpu_h(self) -> float:
        """Saved less spent."""
        return self.saved_gpu_h - self.spent_gpu_h


def _end(s: Slowdown, job: JobTruth) -> float:
    return min(s.end_ts, job.end_ts)


def measurable(s: Slowdown, job: JobTruth) -> bool:
    """A fault that leaves the job ranks to compare with (one that slows every rank, a whole
    node of a one-node job, moves the median with it: no timing can name it)."""
    return s.fault and len(s.ranks) < job.world


def never_lost(month: Month) -> float:
    """GPU-hours the month's faults cost when nothing is ever evicted."""
    return sum(
        job.gpu_hours(s.loss_frac * max(0.0, _end(s, job) - s.onset_ts))
        for job in month.jobs
        for s in job.slowdowns
        if measurable(s, job)
    )


def _net_at(s: Slowdown, job: JobTruth, t: float) -> tuple[float, float]:
    """(seconds saved, seconds spent) by evicting ``s``'s node at ``t``."""
    saved = s.loss_frac * max(0.0, _end(s, job) - t)
    return saved, job.restart_s + max(0.0, t - job.last_checkpoint(t))


def oracle(month: Month) -> Score:
    """Each fault evicted at its best moment when that pays."""
    score = Score(lost_gpu_h=never_lost(month))
    for job in month.jobs:
        for s in job.slowdowns:
            if not measurable(s, job):
                continue
            best = (0.0, 0.0)
            t = s.onset_ts
            for _ in range(64):  # the onset, then each checkpoint while it lasts
                if t >= _end(s, job):
                    break
                saved, spent = _net_at(s, job, t)
                if saved - spent > best[0] - best[1]:
                    best = (saved, spent)
                t = job.next_checkpoint(t)
            if best[0] > best[1]:
                score.evictions += 1
                score.saved_gpu_h += job.gpu_hours(best[0])
                score.spent_gpu_h += job.gpu_hours(best[1])
    score.lost_gpu_h -= score.net_gpu_h
    return score


def score(month: Month, result: dict[str, Any]) -> Score:
    """Score a backtest's JSON (``detections``, ``persistent_nodes``) against the truth."""
    jobs = {j.job_id: j for j in month.jobs}
    out = Score(lost_gpu_h=never_lost(month))
    stragglers = [d for d in result["detections"] if d["kind"] == "straggler"]
    fixed: set[int] = set()
    for d in stragglers:
        if d["action"] != "evict":
            continue
        job, t = jobs[d["job_id"]], float(d.get("acted_ts") or d["ts"])
        out.evictions += 1
        spent = job.restart_s + max(0.0, t - job.last_checkpoint(t))
        out.spent_gpu_h += job.gpu_hours(spent)
        on = []
        for node in d.get("nodes") or [d["node"]]:  # one requeue, every node it excluded
            here = [
                s
                for s in job.slowdowns
                if s.node == node and s.fault and s.onset_ts <= t < _end(s, job)
            ]
            if not any(s.sustained(job) for s in here):
                out.needless += 1
                out.needless_list.append(f"{job.job_id}:{node} ({_what(job, node, t)})")
            on += here
        saved = 0.0
        for s in on:
            if id(s) not in fixed:
                fixed.add(id(s))
                saved += s.loss_frac * max(0.0, _end(s, job) - t)
        out.saved_gpu_h += job.gpu_hours(saved)
        if saved <= spent:
            out.not_paying += 1
    out.lost_gpu_h -= out.net_gpu_h
    healthy = month.healthy_nodes()
    out.wrong_persistent = sorted(set(result["persistent_nodes"]) & healthy)
    out.bad_persistent = len(set(result["persistent_nodes"]) & month.bad_nodes)
    out.bad_unmarked = unmarked(month, set(result["persistent_nodes"]))
    seen = {(d["job_id"], d["node"], d["ts"]) for d in stragglers if d["cause"] == "compute"}
    for job in month.jobs:
        for s in job.slowdowns:
            visible = min(_end(s, job), job.trace_end_ts) - s.onset_ts
            if not (
                measurable(s, job)
                and s.sustained(job)
                and visible >= VISIBLE_S
                and s.loss_frac >= MISSED_MIN_LOSS
            ):
                continue
            hit = any(
                j == job.job_id and n == s.node and s.onset_ts <= ts <= _end(s, job)
                for j, n, ts in seen
            )
            if not hit:
                out.missed.append(f"{job.job_id}:{s.node} {s.kind} +{s.extra:.0%}")
    return out


def unmarked(month: Month, persistent: set[str]) -> list[str]:
    """Bad nodes (a fault of their own) sustained-slow in two or more jobs, not persistent."""
    slow_in: dict[str, set[str]] = {}
    for job in month.jobs:
        for s in job.slowdowns:
            if s.node in month.bad_nodes and measurable(s, job) and s.sustained(job):
                slow_in.setdefault(s.node, set()).add(job.job_id)
    return sorted(n for n, seen in slow_in.items() if len(seen) >= 2 and n not in persistent)


def unmarked_why(month: Month, node: str, result: dict[str, Any]) -> str:
    """What a bad node's sustained slowdowns were, job by job (what it cost each job and
    whether the job was evicted from it), to tell an unmarked node that no timing could
    see (a slowdown that costs its job nothing) from one a decision missed."""
    evicted = {
        (d["job_id"], n)
        for d in result["detections"]
        if d["kind"] == "straggler" and d["action"] == "evict"
        for n in d.get("nodes") or [d["node"]]
    }
    parts = []
    for job in month.jobs:
        for s in job.slowdowns:
            if s.node == node and measurable(s, job) and s.sustained(job):
                done = ", evicted" if (job.job_id, node) in evicted else ""
                ranks = f"{len(s.ranks)} of {job.world} ranks"
                parts.append(
                    f"job {job.job_id} {s.kind} +{s.extra:.0%} on {ranks} {job.structure}, "
                    f"costs the job {s.loss_frac:.1%}{done}"
                )
    return "; ".join(parts)


def _what(job: JobTruth, node: str, t: float) -> str:
    kinds = [s.kind for s in job.slowdowns if s.node == node and s.onset_ts <= t < _end(s, job)]
    return ",".join(kinds) or f"healthy, structure {job.structure}"
