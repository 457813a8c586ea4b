"""A job id is not a job: Slurm gives the same id again after a controller reinstall (ids
start at 1) or when ``MaxJobId`` wraps. What the service keeps about a job (its eviction count,
cooldown, cursors, open decisions, node-history incidents) belongs to one job, which it tells
from a later one with that id by what Slurm says of it, never by text the job controls:

- the job's user;
- its submit time, which Slurm moves on every requeue, when it also counts a restart;
- where the release gives one (25.11 on), the run's unique id (SLUID), which a requeue renews.

So a job is the one we know under its id while its user is the same and its run (SLUID) or
submit time is the one we saw, or it has been requeued since (more restarts than we saw). A
job with the same id, another user, or another run or submit time without a restart, is
another job.

The token (``JOBID.FIRST_SUBMIT``) names the job in node history: two jobs with one id are
two jobs there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import structlog

from slurm_plugin.model import keys
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.service.state import OPEN_STATES, ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.store import job_state
from slurm_plugin.store.job_state import JobState
from slurm_plugin.store.telemetry_store import TelemetryStore

log = structlog.get_logger(__name__)

#: A submit time that moved by less than this is the same (Slurm keeps whole seconds).
_SAME_SECOND = 1.0


@dataclass(frozen=True)
class Known:
    """What the service recorded of the job it knows under an id."""

    user: str
    submit_ts: float | None
    restarts: int
    first_submit_ts: float | None
    #: The run's SLUID when the release gives one.
    sluid: str | None = None

    @classmethod
    def of(
        cls,
        fields: Mapping[str, str],
        prefix: str = "identity_",
    ) -> Known | None:
        """The identity kept in ``fields`` (a job's service state, or a decision's ``job_``
        fields), or None when it holds none (a job first seen now)."""
        user = fields.get(f"{prefix}user")
        if user is None:
            return None
        return cls(
            user,
            _number(fields.get(f"{prefix}submit_ts")),
            int(_number(fields.get(f"{prefix}restarts")) or 0),
            _number(fields.get(f"{prefix}first_submit_ts")),
            fields.get(f"{prefix}sluid") or None,
        )


def same_job(known: Known, job: JobInfo) -> bool:
    """True when ``job`` is the job ``known`` describes (requeues included)."""
    if known.user and job.user and known.user != job.user:
        return False
    if known.sluid and job.sluid:  # Slurm names the run: the one we saw, or a requeue since
        return known.sluid == job.sluid or job.restarts > known.restarts
    if known.submit_ts is None or job.submit_time is None:
        return True  # nothing to tell them apart by: the job we know
    if abs(job.submit_time - known.submit_ts) < _SAME_SECOND:
        return job.restarts >= known.restarts
    return job.restarts > known.restarts


def fields_of(job: JobInfo, known: Known | None, prefix: str = "identity_") -> dict[str, str]:
    """The identity fields to keep for ``job`` (``known``: what was kept, the same job)."""
    first = known.first_submit_ts if known is not None else None
    if first is None:
        first = job.submit_time
    return {
        f"{prefix}user": job.user,
        f"{prefix}submit_ts": _text(job.submit_time),
        f"{prefix}restarts": str(job.restarts),
        f"{prefix}first_submit_ts": _text(first),
        f"{prefix}sluid": job.sluid or "",
    }


def token(job_id: str, first_submit_ts: float | None) -> str:
    """The job's name in node history: its id and first submit time."""
    return job_id if first_submit_ts is None else f"{job_id}.{first_submit_ts:.0f}"


def describe(job: JobInfo) -> str:
    """How a job that took an id over is named in the audit."""
    submitted = "an unknown time" if job.submit_time is None else f"{job.submit_time:.0f}"
    return f"user {job.user or '?'}, submitted at {submitted}, {job.restarts} restart(s)"


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _text(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


class Identities:
    """Each cycle, the jobs Slurm lists checked against what the service keeps under their
    ids; the state of an earlier job with the same id is closed and forgotten, never used."""

    def __init__(
        self,
        state: ServiceState,
        store: TelemetryStore,
        deployment: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = state
        self.store = store
        self.deployment = deployment
        self.clock = clock
        self._restored: set[str] = set()  # eviction marks checked against the budget
        self.tokens: dict[str, str] = {}
        #: Each checked job's service state as it stands after the check (the cycle reads its
        #: cursors and waiting decision from it: one read of every job's state a cycle).
        self.states: dict[str, JobState] = {}

    def check(self, jobs: Iterable[JobInfo]) -> list[str]:
        """Record or update each job's identity; returns the ids Slurm now gives another job
        (their old state is gone: the caller drops what it keeps in memory for them)."""
        reused = []
        self.tokens = {}
        listed = list(jobs)
        states = self.state.jobs([job.job_id for job in listed])  # one round trip for all
        self.states = {}
        for job in listed:
            kept = states[job.job_id]
            known = Known.of(kept)
            if known is not None and not same_job(known, job):
                kept = self._forget(job, kept)
                reused.append(job.job_id)
                known = None
            fields = fields_of(job, known)
            if known is None and job.restarts > 0 and not _number(kept.get("evictions")):
                # First seen already requeued: Redis lost what we did (restarted empty) or
                # the job was requeued before; Slurm's count bounds max_requeues either way.
                fields["evictions"] = str(job.restarts)
                log.warning(
                    "service.evictions_from_slurm", job_id=job.job_id, restarts=job.restarts
                )
                fields.update(self._restore_budget(job))
            if known is None or any(kept.get(k) != v for k, v in fields.items()):
                self.state.update_job(job.job_id, **fields)
            self.states[job.job_id] = job_state.read({**kept, **fields})
            self.tokens[job.job_id] = token(job.job_id, _number(fields["identity_first_submit_ts"]))
        return reused

    def _restore_budget(self, job: JobInfo) -> dict[str, str]:
        """A job first seen requeued with our eviction mark: Redis lost that eviction (it
        restarted empty). It goes back into the hourly budget, dated by Slurm's SubmitTime
        (which a requeue moves to the requeue's time), and starts the job's cooldown; the
        fields to keep for the job."""
        found = marks.eviction_of(job.admin_comment, self.deployment)
        if found is None:
            return {}
        ours = found[0]
        now = self.clock()
        when = min(now, job.submit_time) if job.submit_time is not None else now
        if ours not in self._restored and self.state.restore_eviction(ours, when, now):
            log.warning(
                "service.eviction_restored",
                job_id=job.job_id,
                decision_id=ours,
                at=round(when),
                why="Redis did not know it: counted in the hourly budget from Slurm's mark",
            )
        self._restored.add(ours)
        return {"last_eviction_ts": f"{when:.3f}"}

    def restore_waiting(self, jobs: Iterable[JobInfo]) -> None:
        """:meth:`_restore_budget` for jobs requeued and not running yet (pending, held):
        :meth:`check` sees a job only once it runs again."""
        for job in jobs:
            if not job.running and job.restarts > 0 and marks.PREFIX in job.admin_comment:
                self._restore_budget(job)

    def token(self, job: JobInfo) -> str:
        """The job's name in node history (its id until checked)."""
        return self.tokens.get(job.job_id, job.job_id)

    def _forget(self, job: JobInfo, kept: Mapping[str, str]) -> dict[str, str]:
        """Close and drop the earlier job's state; the state the id starts with now."""
        now = describe(job)
        why = f"job id {job.job_id} is now another job ({now}): nothing more is done for it"
        for decision in self.state.job_records(job.job_id):
            if decision.state in OPEN_STATES:
                self.state.save_decision(decision.id, {"state": "abandoned", "error": why})
        self.state.forget_job(job.job_id)
        # Entries Redis kept from the old job (a stream that outlived it) are skipped: the
        # cursors start at the streams' ends now (the new job's first seconds may go too).
        steps = self.store.steps_mark(job.job_id)
        events = self.store.stream_mark(keys.job_events(job.job_id))
        fresh = {
            "steps_cursor": steps.last_id if steps else "0-0",
            "steps_read": str(steps.added if steps else 0),
            "events_cursor": events.last_id if events else "0-0",
        }
        self.state.update_job(job.job_id, **fresh)
        log.warning(
            "service.job_id_reused",
            job_id=job.job_id,
            was_user=kept.get("identity_user"),
            was_submitted=kept.get("identity_submit_ts"),
            now=now,
        )
        return fresh
