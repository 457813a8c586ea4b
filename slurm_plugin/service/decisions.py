"""The service carries out the decision lifecycle's effects (policy/lifecycle.py) on Redis
and Slurm: a decision recorded or waiting, a candidate joined, a waiting decision closed,
advice to the job (store/advice.py), an eviction (counted, marked, requeued, valued, timed).
The backtest carries out the same effects in memory (replay.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import redis
import structlog

from slurm_plugin.detection import StragglerEvent
from slurm_plugin.errors import StragglerError
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.policy import lifecycle
from slurm_plugin.policy.lifecycle import (
    Advise,
    Close,
    Effect,
    Evict,
    Joined,
    Missed,
    Rechecking,
    Record,
    Waiting,
)
from slurm_plugin.policy.schema import Policy
from slurm_plugin.service.executor import Executor
from slurm_plugin.service.metrics import Metrics
from slurm_plugin.service.recovery import Kind, RecoveryClock
from slurm_plugin.service.state import ServiceState
from slurm_plugin.service.value import Value
from slurm_plugin.service.waiting import candidates_field, event_fields, waiting_of
from slurm_plugin.slurm import marks
from slurm_plugin.store import advice
from slurm_plugin.store.decision import verdict_fields
from slurm_plugin.store.job_state import JobState

log = structlog.get_logger(__name__)

#: What an operator reads when Slurm refuses our mark on a job (AdminComment).
MARK_HINT = (
    "Our marks live in the job's AdminComment, which only a Slurm administrator may set: "
    "grant the service account AdminLevel=Admin (docs/deploy.md, The service account)"
)
#: Fields of a waited eviction's record that stay as the first decision found them.
_KEPT = {"hardware_evidence", "job_reported_gpu"}


class Decisions:
    """Carries out the lifecycle's effects for one service."""

    def __init__(
        self,
        state: ServiceState,
        executor: Executor,
        metrics: Metrics,
        value: Value,
        clock: Callable[[], float],
        *,
        recovery: RecoveryClock | None = None,
        dry_run: bool = False,
    ) -> None:
        self.state = state
        self.executor = executor
        self.metrics = metrics
        self.value = value
        self.clock = clock
        #: Times each action's recovery (onset to the job's first healthy step).
        self.recovery = recovery if recovery is not None else RecoveryClock()
        self.dry_run = dry_run

    # -- the lifecycle's state -----------------------------------------------------------
    def waiting(self, job_state: JobState) -> Waiting | None:
        """The job's open waiting decision (``job_state``: its service state, as read this
        cycle), as the lifecycle's state (None: idle)."""
        if not job_state.waiting:
            return None
        return waiting_of(self.state.record(job_state.waiting), job_state.waiting_since)

    def evicting(self, job_id: str) -> bool:
        """An eviction of this job is still open (its outcome not yet known)."""
        return any(
            d.job_id == job_id and d.action == "evict" and d.state != "waiting"
            for d in self.state.open_records()
        )

    # -- effects ---------------------------------------------------------------------------
    def carry_out(
        self,
        effects: Iterable[Effect],
        job: JobInfo,
        policy: Policy,
        now: float,
        base: dict[str, Any] | None = None,
        evidence: tuple[list[str], list[str]] = ([], []),
    ) -> list[dict[str, Any]]:
        """Each effect, in order; what was done, for the cycle's report. ``base`` and
        ``evidence``: the new decision's record fields (its job, policy, detection) and the
        hardware evidence the service found for it."""
        done: list[dict[str, Any]] = []
        for effect in effects:
            if isinstance(effect, Record):
                record = _record(effect, base, evidence)
                waits = effect.state == "waiting"
                action = "wait" if waits else effect.decision.action
                self.state.save_decision(
                    effect.decision_id, {**record, "state": effect.state, "action": action}
                )
                if waits:
                    self.state.update_job(
                        job.job_id, waiting=effect.decision_id, waiting_since=f"{now:.3f}"
                    )
                if effect.annotate:
                    self.annotated(effect.decision_id, job, self._mark(effect), policy)
                done.append(
                    {"id": effect.decision_id, "action": action, "reasons": effect.decision.reasons}
                )
            elif isinstance(effect, Joined):
                self.state.save_decision(
                    effect.decision_id, {"candidates": candidates_field(effect.waiting)}
                )
            elif isinstance(effect, Rechecking):
                self.state.save_decision(
                    effect.decision_id,
                    {"waiting_for": "recheck", "rechecking_since": f"{effect.since:.3f}"},
                )
            elif isinstance(effect, Missed):
                # Decided on as if the job reported no checkpoints until its next one.
                self.state.update_job(job.job_id, wait_expired_ts=f"{effect.now:.3f}")
            elif isinstance(effect, Close):
                self._close(job.job_id, effect)
            elif isinstance(effect, Advise):
                done.append(self._advise(effect, job, policy, now, base, evidence))
            else:
                done.append(self._evict(effect, job, policy, now, base, evidence))
        return done

    def ended(self, running: set[str]) -> list[str]:
        """The lifecycle's :func:`~slurm_plugin.policy.lifecycle.ended` for every waiting
        decision of a job not in ``running`` (Slurm's answer, never a guess while it is
        away); the ids closed."""
        closed = []
        for rec in self.state.open_records():
            if rec.state == "waiting" and rec.job_id not in running:
                _, effects = lifecycle.ended(rec.id)
                for effect in effects:
                    if isinstance(effect, Close):
                        self._close(rec.job_id or "", effect)
                closed.append(rec.id)
        return closed

    def _close(self, job_id: str, effect: Close) -> None:
        if effect.acted:
            self.state.save_decision(effect.decision_id, {"state": "acted", "note": effect.note})
            self.state.update_job(job_id, waiting="", waiting_since="")
            self._withdraw(job_id, effect.decision_id)
            self.metrics.actions.labels(action="advise", outcome="acted").inc()
            log.info(
                "service.advice_acted",
                decision_id=effect.decision_id,
                job_id=job_id,
                note=effect.note,
            )
            return
        if effect.abandoned:
            self.state.save_decision(
                effect.decision_id, {"state": "abandoned", "error": effect.note}
            )
            return
        fields: dict[str, Any] = {"state": "recorded", "decision": "none"}
        if effect.reasons:
            fields["reasons"] = list(effect.reasons)
            log.info(
                "service.decision",
                decision_id=effect.decision_id,
                job_id=job_id,
                action="none",
                reasons=list(effect.reasons),
            )
        if effect.note:
            fields["note"] = effect.note
        self.state.save_decision(effect.decision_id, fields)
        self.state.update_job(job_id, waiting="", waiting_since="")

    def _advise(
        self,
        effect: Advise,
        job: JobInfo,
        policy: Policy,
        now: float,
        base: dict[str, Any] | None,
        evidence: tuple[list[str], list[str]],
    ) -> dict[str, Any]:
        """The decision waits for the job to leave the nodes itself: recorded, our mark on
        the job, the advice published where the job reads it (not in a dry run)."""
        record = _record(effect, base, evidence)
        record.update(self._annotate(job, self._mark(effect), policy))
        nodes = list(effect.nodes)
        self.state.save_decision(
            effect.decision_id,
            {
                **record,
                "state": "waiting",
                "action": "advise",
                "job_id": job.job_id,
                "node": nodes[0],
                "nodes": nodes,
                "advice_deadline_ts": f"{effect.deadline_ts:.3f}",
                # Every advised node with its own event: decided again at the deadline.
                "candidates": candidates_field(effect.waiting),
            },
        )
        known = self.state.job_state(job.job_id).advised()
        self.state.update_job(
            job.job_id,
            waiting=effect.decision_id,
            waiting_since=f"{now:.3f}",
            advised_nodes=",".join(sorted({*known, *nodes})),
        )
        outcome = "advised"
        if self.dry_run:
            outcome = "planned"
        else:
            given = advice.Advice(
                job_id=job.job_id,
                decision_id=effect.decision_id,
                leave=nodes,
                reasons=list(effect.decision.reasons),
                slowdown_pct=effect.event.slowdown_pct,
                issued_ts=now,
                deadline_ts=effect.deadline_ts,
            )
            try:
                advice.publish(self.state.client, given)
            except redis.RedisError as exc:  # requeued at the deadline, as if not acted on
                outcome = "failed"
                log.warning("service.advice_failed", job_id=job.job_id, error=str(exc))
        if outcome == "advised":
            self._time_recovery(job.job_id, "advice", effect.decision_id, effect.event, now)
        self.metrics.actions.labels(action="advise", outcome=outcome).inc()
        log.info(
            "service.advice",
            decision_id=effect.decision_id,
            job_id=job.job_id,
            leave=nodes,
            deadline_ts=round(effect.deadline_ts, 3),
            outcome=outcome,
        )
        return {"id": effect.decision_id, "action": "advise", "outcome": outcome}

    def _time_recovery(
        self, job_id: str, kind: Kind, decision_id: str, event: StragglerEvent, now: float
    ) -> None:
        """Start the clock of the job's recovery: from the slowdown's onset and from now."""
        onset = event.since_ts if event.since_ts is not None else event.ts
        if not self.recovery.acted(job_id, kind, decision_id, onset, now):
            log.info("service.recovery_untimed", job_id=job_id, why="no pace before the onset")

    def _withdraw(self, job_id: str, decision_id: str) -> None:
        """The decision's advice no longer holds (acted on, or the job requeued)."""
        try:
            advice.withdraw(self.state.client, job_id, decision_id)
        except (redis.RedisError, StragglerError) as exc:  # it expires by itself
            log.warning("service.advice_withdraw_failed", job_id=job_id, error=str(exc))

    def _mark(self, effect: Record | Evict | Advise) -> str:
        event = effect.event
        action = (
            "evict"
            if isinstance(effect, Evict)
            else "advise"
            if isinstance(effect, Advise)
            else effect.decision.action
        )
        return marks.reason(
            f"{event.cause} {event.node}",
            f"+{event.slowdown_pct:.1f}% {action}",
            effect.decision_id,
            self.executor.deployment or "",
        )

    def _evict(
        self,
        effect: Evict,
        job: JobInfo,
        policy: Policy,
        now: float,
        base: dict[str, Any] | None,
        evidence: tuple[list[str], list[str]],
    ) -> dict[str, Any]:
        """Mark the job, count the eviction (before acting: a crash mid-eviction must not
        allow one more than the policy's maximum), requeue it without the nodes; then what it
        spent and is expected to save, and how long it took from the detection."""
        decision = effect.decision
        record = _record(effect, base, evidence)
        if effect.after != "detection":  # a waited decision keeps what was first found
            record = {k: v for k, v in record.items() if k not in _KEPT}
            record["after"] = effect.after
            log.info(
                "service.decision",
                decision_id=effect.decision_id,
                job_id=job.job_id,
                node=effect.event.node,
                action="evict",
                reasons=decision.reasons,
                after=effect.after,
            )
        record.update(self._annotate(job, self._mark(effect), policy))  # saved with it
        since_start = effect.event.attempt if effect.event.from_start else None
        outcome = self._requeue(effect.decision_id, job, effect.nodes, record, now, since_start)
        if effect.after == "advice deadline":
            self._withdraw(job.job_id, effect.decision_id)
        if outcome != "failed" and not self.dry_run:
            self._time_recovery(job.job_id, "requeue", effect.decision_id, effect.event, now)
        self.value.evicted(job.job_id, decision, outcome)
        self.metrics.decision_seconds.observe(max(0.0, self.clock() - effect.detected_ts))
        return {"id": effect.decision_id, "action": "evict", "outcome": outcome}

    def _requeue(
        self,
        decision_id: str,
        job: JobInfo,
        nodes: tuple[str, ...],
        record: dict[str, Any],
        now: float,
        since_start: int | None = None,
    ) -> str:
        """A job Slurm would not let us mark is never evicted: without our mark nothing could
        tell our hold from another's, or undo it, after a restart that lost Redis."""
        if record.get("mark_refused"):
            self.state.save_decision(
                decision_id,
                {
                    **record,
                    "state": "failed",
                    "action": "evict",
                    "job_id": job.job_id,
                    "node": nodes[0],
                    "error": f"not evicted: Slurm refused our mark on the job. {MARK_HINT}",
                },
            )
            self.metrics.actions.labels(action="evict", outcome="failed").inc()
            return "failed"
        evictions = self.state.job_state(job.job_id).evictions
        # The attempt requeued for a slowdown there since its first steps: one that comes
        # back from the next attempt's first steps is the job's design (policy/decide.py).
        came_back = {} if since_start is None else {"from_start_requeued": since_start}
        self.state.update_job(
            job.job_id,
            evictions=evictions + 1,
            last_eviction_ts=f"{now:.3f}",
            waiting="",
            waiting_since="",
            **came_back,
        )
        outcome = self.executor.evict(decision_id, job, nodes, record)
        self.metrics.actions.labels(action="evict", outcome=outcome).inc()
        return outcome

    def _annotate(self, job: JobInfo, text: str, policy: Policy) -> dict[str, str]:
        """Our mark on the job (when the policy notifies by comment), read back; the fields
        for its decision when Slurm does not show it."""
        if (
            self.dry_run
            or policy.actions.mode in {"off", "observe"}  # observe writes nothing to Slurm
            or policy.actions.notify != "comment"
        ):
            log.info("service.notify", job_id=job.job_id, text=text, notify=policy.actions.notify)
            return {}
        try:
            outcome = self.executor.annotate(job, text)
        except StragglerError as exc:
            if "permission denied" in str(exc).lower():  # Slurm answered: not ours to mark
                log.error(  # noqa: TRY400 - a refusal Slurm answered: no traceback to show
                    "service.mark_refused", job_id=job.job_id, error=str(exc), hint=MARK_HINT
                )
                return {"annotated": f"refused: {exc}"[:200], "mark_refused": "yes"}
            outcome = f"failed: {exc}"
        if outcome == "verified":
            return {}
        # Read back: the decision says its mark is not on the job.
        log.warning("service.annotate_unconfirmed", job_id=job.job_id, outcome=outcome)
        return {"annotated": outcome[:200]}

    def annotated(self, decision_id: str, job: JobInfo, text: str, policy: Policy) -> None:
        """:meth:`_annotate` for a decision already saved: what Slurm showed goes into it."""
        unconfirmed = self._annotate(job, text, policy)
        if unconfirmed:
            self.state.save_decision(decision_id, unconfirmed)


def _record(
    effect: Record | Evict | Advise,
    base: dict[str, Any] | None,
    evidence: tuple[list[str], list[str]],
) -> dict[str, Any]:
    """A decision's record: its job and detection (``base``), the event, the evidence and the
    verdict with its numbers, and what the lifecycle settled beyond the verdict."""
    event, decision = effect.event, effect.decision
    return {
        **(base or {}),
        **verdict_fields(event, decision, *evidence, effect.node_incidents),
        **event_fields(event),
        **effect.extra,
    }
