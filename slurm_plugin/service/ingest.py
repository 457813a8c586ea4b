"""The service's reading of a job's telemetry each cycle: new step records (through the
evidence rules) into the job's detector, checkpoint events into the job's state, and the
sweep of per-job credentials whose job is gone."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import redis
import structlog

from slurm_plugin.detection import Detector
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.model.columns import Decoded, decode_many
from slurm_plugin.service.evidence import EvidenceFilter
from slurm_plugin.service.metrics import Metrics
from slurm_plugin.service.recovery import Recovered, RecoveryClock
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store import advice, credentials
from slurm_plugin.store.job_state import JobState
from slurm_plugin.store.telemetry_store import (
    Raw,
    Seen,
    StreamMark,
    TelemetryStore,
    entries_page,
    events_of,
)
from slurm_plugin.telemetry.many import Cursor, read_first, read_more

log = structlog.get_logger(__name__)
#: Steps entries read per job per cycle when the stream does not say how many are waiting
#: (Redis before 7.0): a 16k-rank job at 1 step/s (32k entries per 2 s cycle) keeps up.
MAX_ENTRIES_PER_JOB = 100_000
#: When it does, a cycle reads the whole backlog, up to this bound: the read follows the job's
#: size and the interval, so no job falls behind while the service keeps up.
MAX_BACKLOG_PER_JOB = 2_000_000
#: Entries per XRANGE page.
PAGE = 5000
#: Reporter sessions remembered per job for skipping repeats (a job's user could mint a session
#: per flush): past it the oldest half is forgotten, sessions of earlier attempts first. A
#: 131,072-rank job publishing per rank has that many; relays make it one per node.
SEEN_PER_JOB = 1 << 18


@dataclass(frozen=True)
class Kept:
    """What one job's new records added: records believed and ranks they came from."""

    records: int
    ranks: int


class Ingest:
    """Reads each job's streams from its cursor on (cursors live in the job's service state)."""

    def __init__(self, state: ServiceState, store: TelemetryStore, metrics: Metrics) -> None:
        self.state = state
        self.store = store
        self.metrics = metrics
        self.evidence = EvidenceFilter()
        self._last_sweep = 0.0
        self._structure_noted: dict[str, int] = {}  # job id -> attempt whose structure is noted
        self._seen: dict[str, Seen] = {}  # job id -> the flush ids read (repeats are skipped)
        #: Each job's pace, and the clock of its newest recovery (onset to a healthy step).
        self.recovery = RecoveryClock()

    def forget_all_but(self, running: Iterable[str]) -> None:
        """Drop what is kept in memory for jobs no longer running."""
        keep = set(running)
        self.evidence.forget_all_but(keep)
        self._structure_noted = {j: a for j, a in self._structure_noted.items() if j in keep}
        self._seen = {j: s for j, s in self._seen.items() if j in keep}
        self.recovery.forget_all_but(keep)

    def forget(self, job_id: str) -> None:
        """Drop what is kept in memory for one job id (Slurm gave it to another job)."""
        self.evidence.forget(job_id)
        self._structure_noted.pop(job_id, None)
        self._seen.pop(job_id, None)
        self.recovery.forget(job_id)

    def note_structure(self, job: JobInfo, detectors: Iterable[Detector]) -> None:
        """Once per attempt: what the job's detector took for structure (ranks that compute
        longer by design and are compared with themselves) goes into the job's state, for
        `straggler job show`, and the log."""
        if self._structure_noted.get(job.job_id) == job.restarts:
            return
        found = next((f for d in detectors if (f := d.structure(job.job_id))), [])
        if not found:
            return
        self._structure_noted[job.job_id] = job.restarts
        self.state.update_job(job.job_id, structure=found)
        log.info("service.structure", job_id=job.job_id, attempt=job.restarts, groups=found)

    def steps(self, job: JobInfo, detector: Detector) -> tuple[Kept, int]:
        """:meth:`read` of one job."""
        return self.read([(job, detector)])[job.job_id]

    def read(
        self,
        jobs: Sequence[tuple[JobInfo, Detector]],
        known: Mapping[str, JobState] | None = None,
    ) -> dict[str, tuple[Kept, int]]:
        """Feed each job's new, believed records to its detector and note its checkpoints;
        per job, what was kept and how many records the evidence rules dropped. Entries
        trimmed from the stream before they were read are counted (never lost silently).
        Every job is read, decoded and written back together (a few round trips and one
        parse a cycle, whatever the number of jobs); ``known``: the jobs' service state as
        the cycle read it (read here when not given)."""
        if not jobs:
            return {}
        ids = [job.job_id for job, _ in jobs]
        states = known if known is not None else self.state.job_states(ids)
        cursors = [
            Cursor(i, states[i].steps_cursor or "0-0", states[i].events_cursor or "0-0")
            for i in ids
        ]
        first = read_first(self.state.client, cursors, PAGE)  # a text client: hiredis decodes
        reads = [
            _JobRead(c.job_id, f.mark, c.steps_after, c.events_after)
            for c, f in zip(cursors, first, strict=True)
        ]
        for read, page in zip(reads, first, strict=True):
            read.limit = _limit(read.mark, states[read.job_id].steps_read or 0)
            read.take(page.steps, self._seen.setdefault(read.job_id, {}))
        while wanted := [r for r in reads if r.more]:  # the jobs with more waiting
            pages = read_more(
                self.state.client, [(r.job_id, r.cursor, r.until) for r in wanted], PAGE
            )
            for read, raw in zip(wanted, pages, strict=True):
                read.take(raw, self._seen[read.job_id])
        decoded = decode_many([r.fields for r in reads])
        out: dict[str, tuple[Kept, int]] = {}
        updates: dict[str, dict[str, str]] = {}
        for (job, detector), read, page, parts in zip(jobs, reads, first, decoded, strict=True):
            forget_oldest(self._seen[job.job_id], SEEN_PER_JOB)
            known_job = states[job.job_id]
            update = self._account(job, known_job, read, parts)
            update.update(self._checkpoints(job, known_job, page.events, read.events_after))
            updates[job.job_id] = update
            out[job.job_id] = self._believe(job, detector, parts)
        self.state.update_jobs(updates)
        return out

    def _account(
        self, job: JobInfo, known: JobState, read: _JobRead, decoded: Decoded
    ) -> dict[str, str]:
        """The job's cursor and counts after ``read``; repeats, malformed and lost entries
        logged and counted."""
        if decoded.malformed:
            log.warning(
                "telemetry.malformed_entries",
                job_id=job.job_id,
                entries=decoded.malformed,
                errors=decoded.errors,
            )
        total = (known.steps_read or 0) + read.read
        update = {"steps_cursor": read.cursor, "steps_read": str(total)}
        if read.repeats:  # a flush retried after Redis had stored it: read once, counted here
            repeats = (known.steps_repeats or 0) + read.repeats
            update["steps_repeats"] = str(repeats)
            log.info(
                "service.steps_repeated", job_id=job.job_id, entries=read.repeats, total=repeats
            )
        if read.missing:  # numbered by a reporter, never in the stream: a failover lost them
            missing = (known.steps_missing or 0) + read.missing
            update["steps_missing"] = str(missing)
            self.metrics.missing.inc(read.missing)
            log.warning(
                "service.steps_missing",
                job_id=job.job_id,
                entries=read.missing,
                total=missing,
                hint="flushes a rank numbered never reached the stream: lost in a Redis "
                "failover (replication is asynchronous) or dropped by the rank while Redis "
                "was away (its telemetry_dropped event says so)",
            )
        mark = read.mark
        if mark is not None and read.cursor == mark.last_id:  # caught up: the rest was trimmed
            lost = max(0, mark.added - total)
            before = known.steps_lost or 0
            if lost > before:
                update["steps_lost"] = str(lost)
                self.metrics.lost.inc(lost - before)
                log.warning(
                    "service.steps_lost",
                    job_id=job.job_id,
                    entries=lost - before,
                    total=lost,
                    hint="the service fell further behind than the stream keeps (60 s of "
                    "every rank's flushes): see the cycle time in `straggler status`",
                )
        return update

    def _believe(self, job: JobInfo, detector: Detector, decoded: Decoded) -> tuple[Kept, int]:
        """The evidence rules over the job's decoded records; the believed go to ``detector``."""
        batch = decoded.batch
        keep, dropped = self.evidence.judge(
            job, batch.rank, decoded.node_code, decoded.nodes, batch.attempt, batch.ts
        )
        kept = batch if keep.all() else batch.take(keep)  # the batch is the job's own copy
        if dropped:
            self.state.count_ignored(job.job_id, dropped)
            for reason, count in dropped.items():
                self.metrics.ignored.labels(reason=reason).inc(count)
            log.warning("service.records_ignored", job_id=job.job_id, **dropped)
        if len(kept):
            detector.add(job.job_id, kept)
            done = self.recovery.feed(job.job_id, kept)
            if done is not None:
                self._recovered(done)
        return Kept(len(kept), _distinct(kept.rank)), len(batch) - len(kept)

    def _recovered(self, done: Recovered) -> None:
        """A recovery timed: the metric (onset and action to the healthy step) and a log line."""
        for since, seconds in (
            ("onset", done.onset_to_healthy_s),
            ("action", done.action_to_healthy_s),
        ):
            self.metrics.recovery_seconds.labels(recovery=done.kind, since=since).observe(seconds)
        log.info(
            "service.recovered",
            job_id=done.job_id,
            decision_id=done.decision_id,
            recovery=done.kind,
            onset_to_healthy_s=round(done.onset_to_healthy_s, 1),
            action_to_healthy_s=round(done.action_to_healthy_s, 1),
        )

    def _checkpoints(self, job: JobInfo, known: JobState, raw: Raw, after: str) -> dict[str, str]:
        """The job's newest checkpoint (and that it reports checkpoints at all), and the
        period between its checkpoints (the goodput rule's wait for the next one)."""
        events, cursor, malformed = events_of(job.job_id, raw, after)
        update = {"events_cursor": cursor}
        if malformed:  # counted where `job show` finds it; the cycle goes on
            self.state.count_ignored(job.job_id, {"malformed_event": malformed})
            self.metrics.ignored.labels(reason="malformed_event").inc(malformed)
        acted = advice.acted_of(events)
        if acted:  # the job's word that it left nodes on our advice (lifecycle.tick weighs it)
            pairs = [p for p in (known.advice_acted or "").split(",") if p]
            pairs += [f"{d}:{n}" for d, n in acted if f"{d}:{n}" not in pairs]
            update["advice_acted"] = ",".join(pairs[-64:])
            log.info("service.advice_reported", job_id=job.job_id, acted=acted)
        ends = [e["ts"] for e in events if e.get("name") == "checkpoint_end"]
        checkpoints = [t for t in ends if isinstance(t, int | float) and math.isfinite(t)]
        if checkpoints:  # a forged or broken ts is ignored, never fatal to the cycle
            newest = max(checkpoints)
            update.update(last_checkpoint_ts=f"{newest:.3f}", reports_checkpoints="1")
            previous = known.last_checkpoint_ts
            earlier = sorted({*checkpoints, *([previous] if previous is not None else [])})
            gaps = [b - a for a, b in itertools.pairwise(earlier) if b > a]
            if gaps:
                update["checkpoint_period_s"] = f"{statistics.median(gaps):.3f}"
        return update

    def sweep_credentials(self, known: set[str], now: float, every_s: float = 30.0) -> None:
        """Every ``every_s``: revoke the per-job credentials of jobs Slurm no longer lists
        (``known`` must be Slurm's answer, never a guess while it is away)."""
        if now - self._last_sweep < every_s:
            return
        self._last_sweep = now
        try:
            revoked = credentials.sweep(self.store.client, known)
        except redis.RedisError as exc:
            log.warning("service.credential_sweep_failed", error=str(exc))
            return
        if revoked:
            log.warning("service.credentials_revoked", jobs=revoked, why="job gone, no epilog")


@dataclass
class _JobRead:
    """One job's steps read of this cycle, page by page."""

    job_id: str
    mark: StreamMark | None
    cursor: str
    events_after: str = "0-0"
    limit: int = MAX_ENTRIES_PER_JOB
    fields: list[Mapping[str, str]] = field(default_factory=list)
    read: int = 0
    repeats: int = 0
    missing: int = 0
    more: bool = False

    @property
    def until(self) -> str:
        """The last entry this cycle reads: the mark's (read before the entries), else all."""
        return self.mark.last_id if self.mark is not None else "+"

    def take(self, raw: Raw, seen: Seen) -> None:
        """One page in; whether another is wanted (the page was full, the limit not reached)."""
        page = entries_page(raw, self.cursor, self.until, seen)
        self.fields += page.entries
        self.read += page.read
        self.repeats += page.repeats
        self.missing += page.missing
        moved = page.last_id != self.cursor
        self.cursor = page.last_id
        self.more = moved and len(raw) >= PAGE and self.read < self.limit
        if self.mark is not None and self.cursor == self.mark.last_id:
            self.more = False


def _distinct(values: np.ndarray) -> int:
    """How many distinct values (a set for the few rows of a cycle of most jobs: a sort costs
    more there)."""
    return len(set(values.tolist())) if len(values) <= 4096 else len(np.unique(values))


def _limit(mark: StreamMark | None, done: int) -> int:
    """Entries a cycle may read from a job: the whole backlog when the stream says how much
    is waiting (up to :data:`MAX_BACKLOG_PER_JOB`), else :data:`MAX_ENTRIES_PER_JOB`."""
    if mark is None:
        return MAX_ENTRIES_PER_JOB
    return min(MAX_BACKLOG_PER_JOB, max(MAX_ENTRIES_PER_JOB, mark.added - done))


def forget_oldest(seen: Seen, cap: int) -> None:
    """Above ``cap`` sessions, forget the oldest until half of ``cap`` remain (a dict keeps its
    insertion order: the sessions first read go first)."""
    if len(seen) <= cap:
        return
    for key in list(itertools.islice(seen, len(seen) - cap // 2)):
        del seen[key]
