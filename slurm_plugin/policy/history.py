"""Node history across jobs (pure): incidents with time decay, persistent stragglers.

A node becomes a *persistent straggler* after ``incidents`` compute incidents within
``window_s`` that come from at least ``distinct_jobs`` (>= 2) different jobs, so one job's
telemetry can never mark a node on its own. It is forgiven (history cleared) after
``forgive_after_s`` without an incident. Input-bound incidents (slow data) never count: they
say nothing about the node. The window (30 days) is as long as the quiet time that forgives a
node: a bad node's jobs can be weeks apart (on the month benchmark, 9 of the 14 bad nodes left
unmarked under 7 days were marked under 14, two more under 30 that were evicted 18-19 days
apart, and no healthy one). What an incident in another job does to the next job's decisions
(believed sooner, never that job's structure) lasts ``recent_s`` (7 days): the same 14 days
for both made healthy nodes of structured jobs evicted on the month benchmark.

An incident is a confirmed, sustained slowdown: one that has lasted ``sustained_s`` when it is
reported, counted once however often it is reported (its episode: the job and when it began).
On a node another job saw slow in an incident within ``recent_s``, ``repeat_s`` is enough (such
a node is evicted within seconds of its next slowdown); it is ``sustained_s`` by default: a
shorter one marked healthy nodes persistent on the month benchmark's held-out noise model.
A burst that passes, or a report seconds into a slowdown, is never one, unless the job was
requeued without the node for it (an eviction carried out is an incident however short the
slowdown: the job paid a requeue for it, and the next job on the node should know). Structure
(by-design imbalance) is compared with itself by the detector and never reported at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

NodeState = Literal["ok", "suspect", "persistent"]


@dataclass(frozen=True)
class HistoryParams:
    """Persistence policy (policy ``[persistence]`` values)."""

    incidents: int = 2
    distinct_jobs: int = 2
    window_s: float = 30 * 24 * 3600.0
    #: An incident in another job makes a node's next slowdown believed sooner (the goodput
    #: prior, ``repeat_s``) and never that job's structure for this long (the window when that
    #: is shorter: an episode that passed ten days ago says little about today's slowdown).
    recent_s: float = 7 * 24 * 3600.0
    half_life_s: float = 3 * 24 * 3600.0
    forgive_after_s: float = 30 * 24 * 3600.0
    #: Only nodes with at least one incident backed by hardware evidence (sidecar or prolog:
    #: throttling, XIDs, ECC, low clocks) become persistent; timing alone never drains.
    require_corroboration: bool = False
    #: A slowdown becomes an incident once it has lasted this long...
    sustained_s: float = 300.0
    #: ... or this long on a node another job saw slow in an incident within ``recent_s`` (the
    #: same by default: 60 s marked healthy nodes under the held-out noise model).
    repeat_s: float = 300.0

    def __post_init__(self) -> None:
        if self.distinct_jobs < 2:
            raise ValueError("distinct_jobs must be >= 2: one job alone never marks a node")
        if self.incidents < self.distinct_jobs:
            raise ValueError("incidents must be >= distinct_jobs")
        if min(self.window_s, self.half_life_s, self.forgive_after_s, self.recent_s) <= 0:
            raise ValueError("window_s, half_life_s, forgive_after_s and recent_s must be > 0")
        if self.sustained_s < 0:
            raise ValueError("sustained_s must be >= 0")


@dataclass(frozen=True)
class Incident:
    """One straggler detection on a node."""

    job_id: str
    ts: float
    slowdown_pct: float = 0.0
    cause: str = "compute"
    user: str = ""
    #: Hardware evidence (sidecar samples or prolog findings) backed this incident.
    corroborated: bool = False
    #: When the slowdown began (its episode), and how long it had lasted when reported
    #: (None: unknown, an incident recorded before these were kept).
    since_ts: float | None = None
    lasted_s: float | None = None
    #: The report requeued the job without the node (an eviction carried out): an incident
    #: however short the slowdown had lasted, since the job paid a requeue for it.
    evicted: bool = False


@dataclass(frozen=True)
class NodeHistory:
    """What we remember about one node."""

    node: str
    incidents: tuple[Incident, ...] = ()
    state: NodeState = "ok"
    persistent_since: float | None = None
    last_incident: float | None = None
    forgiven: int = 0

    def decayed_incidents(self, now: float, params: HistoryParams) -> float:
        """Decayed incident count (1 for an incident now, 0.5 one half-life ago...)."""
        return float(
            sum(0.5 ** (max(0.0, now - i.ts) / params.half_life_s) for i in self.incidents)
        )


@dataclass(frozen=True)
class Transition:
    """The node history after an update, and whether it just became persistent."""

    history: NodeHistory
    became_persistent: bool = False
    forgiven: bool = False
    reasons: list[str] = field(default_factory=list)


def evaluate(
    history: NodeHistory, now: float, params: HistoryParams, *, distinct_users: bool = False
) -> Transition:
    """Age the history to ``now``: drop incidents outside the window, forgive quiet nodes."""
    if history.last_incident is not None and now - history.last_incident >= params.forgive_after_s:
        forgiven = history.state != "ok" or bool(history.incidents)
        return Transition(
            NodeHistory(history.node, forgiven=history.forgiven + int(forgiven)),
            forgiven=forgiven,
            reasons=["quiet for the forgiveness period"] if forgiven else [],
        )
    recent = tuple(i for i in history.incidents if now - i.ts <= params.window_s)
    jobs = {i.job_id for i in recent}
    sources = {i.user for i in recent} if distinct_users else jobs
    persistent = (
        len(recent) >= params.incidents
        and len(jobs) >= params.distinct_jobs
        and (len(sources) >= params.distinct_jobs)
        and (not params.require_corroboration or any(i.corroborated for i in recent))
    )
    was = history.state == "persistent"
    if was:  # persistence lasts until forgiven, not until incidents age out of the window
        state: NodeState = "persistent"
    else:
        state = "persistent" if persistent else ("suspect" if recent else "ok")
    updated = replace(
        history,
        incidents=recent,
        state=state,
        persistent_since=history.persistent_since if was else (now if persistent else None),
    )
    reasons = []
    if persistent and not was:
        backed = sum(1 for i in recent if i.corroborated)
        reasons.append(
            f"{len(recent)} incidents in {len(jobs)} jobs within {params.window_s / 86400:g} days"
            + (f", {backed} with hardware evidence" if backed else "")
        )
    return Transition(updated, became_persistent=persistent and not was, reasons=reasons)


def is_incident(history: NodeHistory, incident: Incident, params: HistoryParams) -> bool:
    """A compute slowdown that has lasted ``sustained_s``, and the first report of its
    episode (the same job and start) to be one."""
    if incident.cause != "compute":
        return False
    if (
        not incident.evicted
        and incident.lasted_s is not None
        and incident.lasted_s < _needed_s(history, incident, params)
    ):
        return False
    return incident.since_ts is None or not any(
        i.job_id == incident.job_id and i.since_ts == incident.since_ts for i in history.incidents
    )


def _needed_s(history: NodeHistory, incident: Incident, params: HistoryParams) -> float:
    """How long the slowdown must have lasted: ``repeat_s`` on a node another job saw slow in
    an incident within ``recent_s``, else ``sustained_s``."""
    seen = other_jobs(history, incident.job_id, incident.ts, params) > 0
    return min(params.repeat_s, params.sustained_s) if seen else params.sustained_s


def record_incident(
    history: NodeHistory, incident: Incident, params: HistoryParams, *, distinct_users: bool = False
) -> Transition:
    """Add a straggler report as an incident when it is one (:func:`is_incident`) and
    re-evaluate."""
    if not is_incident(history, incident, params):
        return evaluate(history, incident.ts, params, distinct_users=distinct_users)
    aged = evaluate(history, incident.ts, params, distinct_users=distinct_users).history
    added = replace(aged, incidents=(*aged.incidents, incident), last_incident=incident.ts)
    return evaluate(added, incident.ts, params, distinct_users=distinct_users)


def other_jobs(history: NodeHistory, job_id: str, now: float, params: HistoryParams) -> int:
    """How many jobs other than ``job_id`` saw the node slow within ``recent_s``: the node's
    past, as the goodput rule weighs it (a job's own reports never count twice)."""
    return len(
        {
            i.job_id
            for i in history.incidents
            if i.job_id != job_id and i.cause == "compute" and 0 <= now - i.ts <= params.recent_s
        }
    )


def slow_elsewhere(
    histories: Iterable[NodeHistory], job_id: str, now: float, params: HistoryParams
) -> list[str]:
    """The nodes that jobs other than ``job_id`` saw slow within ``recent_s``: a job's
    detector never takes an offset only they share for its structure (a node slow from the
    job's first step in every job it serves is a fault, not a pipeline stage)."""
    return [h.node for h in histories if other_jobs(h, job_id, now, params)]
