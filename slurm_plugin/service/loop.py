"""``straggler serve``: read telemetry, detect, decide, act, verify, audit — every cycle.

One instance leads (a Redis lock); others wait as hot standbys. Policies are re-read every
cycle and the last good set is kept when a file breaks. A failing cycle is logged with its
context and the next one runs anyway.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import redis
import structlog

from slurm_plugin.config import Settings
from slurm_plugin.detection import Detector, Event, RecordBatch, StragglerEvent
from slurm_plugin.errors import StragglerError
from slurm_plugin.policy.decide import ClusterContext, JobContext, decide, is_slowdown
from slurm_plugin.policy.history import Incident, record_incident
from slurm_plugin.policy.loader import (
    active_policies,
    apply_job_overrides,
    policy_from_comment,
)
from slurm_plugin.policy.schema import Policy
from slurm_plugin.service.evidence import EvidenceFilter, gather_evidence
from slurm_plugin.service.executor import Executor
from slurm_plugin.service.fence import FencedScheduler
from slurm_plugin.service.metrics import Metrics
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.slurm.model import JobInfo, NodeInfo
from slurm_plugin.slurm.scheduler import Scheduler
from slurm_plugin.telemetry import credentials
from slurm_plugin.telemetry.store import TelemetryStore

log = structlog.get_logger(__name__)
#: Steps entries read per job per cycle: bounds one cycle after a backlog (a restart) while a
#: 16k-rank job at 1 step/s (32k entries per 2 s cycle) keeps up with room to spare.
_MAX_ENTRIES_PER_JOB = 100_000


@dataclass
class CycleReport:
    """What one cycle saw and did."""

    leader: bool = False
    jobs: int = 0
    ranks: int = 0
    records: int = 0
    ignored_records: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    duration_s: float = 0.0
    error: str | None = None


class Service:
    """The policy service; :meth:`cycle` is one pass, :meth:`run` loops."""

    def __init__(
        self,
        settings: Settings,
        scheduler: Scheduler,
        state: ServiceState,
        store: TelemetryStore,
        *,
        dry_run: bool = False,
        clock: Callable[[], float] = time.time,
        instance: str | None = None,
        metrics: Metrics | None = None,
        lock_ttl_s: float | None = None,
    ) -> None:
        self.settings = settings
        self.state = state
        self.store = store
        self.dry_run = dry_run
        self.clock = clock
        self.instance = instance or f"{socket.gethostname()}:{os.getpid()}"
        self.metrics = metrics or Metrics()
        self.lock_ttl_s = lock_ttl_s or max(10.0, 5 * settings.service_interval_s)
        # Every Slurm-changing call confirms the lock first (the fence), and no step of a cycle
        # waits on Slurm for more than a quarter of the lock's life (verification goes on in
        # the next cycle), so a stalled instance cannot act next to the new leader.
        self.slurm = FencedScheduler(scheduler, lambda: self.state.leads(self.instance))
        self.executor = Executor(
            self.slurm,
            state,
            clock=clock,
            unknown_grace_s=settings.action_grace_s,
            step_budget_s=self.lock_ttl_s / 4,
        )
        self.policies: dict[str, Policy] = {}
        self._detectors: dict[str, Detector] = {}
        self._evidence = EvidenceFilter()
        self._last_sweep = 0.0
        self._job_policy: dict[str, str] = {}
        self._flagged: list[tuple[float, str]] = []

    # -- policies ---------------------------------------------------------------------------
    def reload_policies(self) -> None:
        """Re-read the policy directory and the applied policies; keep the last good set when
        something is broken."""
        try:
            policies = self._read_policies()
        except StragglerError as exc:
            if not self.policies:
                raise
            log.warning("service.policies_invalid", error=str(exc), kept=sorted(self.policies))
            return
        self.policies = policies

    def _read_policies(self) -> dict[str, Policy]:
        policies, problems = active_policies(
            self.settings.policy_dir, self.state.applied_policies()
        )
        for problem in problems:
            log.warning("service.applied_policy_invalid", problem=problem)
        if self.settings.default_policy not in policies:
            raise StragglerError(f"default policy {self.settings.default_policy!r} missing")
        return policies

    def policy_for(self, job: JobInfo) -> Policy:
        """The job's policy: its registration, its comment, else the cluster default; with the
        job's own overrides (sbatch --straggler-*) applied only where they are stricter."""
        meta = self.state.job_meta(job.job_id)
        wanted = meta.get("policy") or policy_from_comment(job.comment) or ""
        if wanted and wanted not in self.policies:
            log.warning("service.unknown_policy", job_id=job.job_id, policy=wanted[:40])
        base = self.policies.get(wanted) or self.policies[self.settings.default_policy]
        return apply_job_overrides(base, meta)

    # -- one cycle ----------------------------------------------------------------------------
    def cycle(self) -> CycleReport:
        """One pass; never raises (the error is in the report and the log)."""
        started = time.monotonic()
        report = CycleReport()
        try:
            self._cycle(report)
        except Exception as exc:  # the loop boundary: one bad cycle never stops the next
            report.error = f"{type(exc).__name__}: {exc}"
            self.metrics.errors.labels(system=type(exc).__name__).inc()
            log.exception("service.cycle_failed", error=report.error)
        report.duration_s = time.monotonic() - started
        self.metrics.cycle_seconds.observe(report.duration_s)
        return report

    def _cycle(self, report: CycleReport) -> None:
        now = self.clock()
        report.leader = self.state.lead(self.instance, ttl_s=self.lock_ttl_s)
        if not report.leader:
            return
        self.reload_policies()
        # Every cycle, not only after a restart: actions whose outcome Slurm did not tell us
        # (timeouts, a restarting slurmctld) are finished as soon as it answers again.
        self.executor.recover()
        jobs = self.slurm.jobs()
        self._sweep_credentials({j.job_id for j in jobs})
        running = {j.job_id: j for j in jobs if j.running}
        nodes = tuple(self.slurm.nodes())
        for job_id in list(self._job_policy):
            if job_id not in running:
                self._detectors[self._job_policy.pop(job_id)].forget(job_id)
        self._evidence.forget_all_but(running)
        for job in running.values():
            policy = self.policy_for(job)
            if policy.actions.mode == "off":
                continue
            self._job_policy[job.job_id] = policy.name
            detector = self._detectors.setdefault(policy.name, Detector(policy.detection.params()))
            self._ingest(job, detector, report)
            self._read_events(job)
        report.jobs = len(self._job_policy)
        events: list[Event] = []
        for detector in self._detectors.values():
            events += detector.advance()
            events += detector.check_hangs(now, only=list(running))
        for event in events:
            target = running.get(event.job_id)
            if target is not None:
                report.events.append(event.to_dict())
                report.decisions.append(self._handle(event, target, nodes, now))
        for job in running.values():
            self._resume_waiting(job, nodes, now, report)
        self._explain_prolog_drains(nodes)
        self.metrics.jobs.set(report.jobs)
        self.metrics.ranks.set(report.ranks)
        self.state.heartbeat(
            self.instance, {"jobs": report.jobs, "ranks": report.ranks, "records": report.records}
        )

    def _ingest(self, job: JobInfo, detector: Detector, report: CycleReport) -> None:
        js = self.state.job(job.job_id)
        cursor = js.get("steps_cursor", "0-0")
        records = []
        for _ in range(_MAX_ENTRIES_PER_JOB // 1000):
            page = self.store.read_steps(job.job_id, cursor, count=1000)
            records += page.records
            if page.last_id == cursor:
                break
            cursor = page.last_id
        kept, dropped = self._evidence.filter(job, records)
        self.state.update_job(job.job_id, steps_cursor=cursor)
        if dropped:
            self.state.count_ignored(job.job_id, dropped)
            for reason, count in dropped.items():
                self.metrics.ignored.labels(reason=reason).inc(count)
            log.warning("service.records_ignored", job_id=job.job_id, **dropped)
        report.ignored_records += len(records) - len(kept)
        report.records += len(kept)
        report.ranks += len({r.rank for r in kept})
        if kept:
            detector.add(job.job_id, RecordBatch.from_records(kept))

    def _read_events(self, job: JobInfo) -> None:
        cursor = self.state.job(job.job_id).get("events_cursor", "0-0")
        events, cursor = self.store.read_events(job.job_id, cursor)
        update: dict[str, Any] = {"events_cursor": cursor}
        ends = [e["ts"] for e in events if e.get("name") == "checkpoint_end"]
        checkpoints = [t for t in ends if isinstance(t, int | float) and math.isfinite(t)]
        if checkpoints:  # a forged or broken ts is ignored, never fatal to the cycle
            update.update(last_checkpoint_ts=f"{max(checkpoints):.3f}", reports_checkpoints="1")
        self.state.update_job(job.job_id, **update)

    # -- decisions ----------------------------------------------------------------------------
    def _context(self, job: JobInfo) -> JobContext:
        js = self.state.job(job.job_id)

        def num(key: str) -> float | None:
            return float(js[key]) if js.get(key) else None

        return JobContext(
            evictions=int(js.get("evictions", "0") or 0),
            last_eviction_ts=num("last_eviction_ts"),
            last_checkpoint_ts=num("last_checkpoint_ts"),
            reports_checkpoints=js.get("reports_checkpoints") == "1",
            waiting_since=num("waiting_since"),
        )

    def _cluster(self, nodes: tuple[NodeInfo, ...], now: float) -> ClusterContext:
        return ClusterContext(
            nodes=nodes,
            evictions_last_hour=self.state.evictions_since(now - 3600),
            paused=self.state.paused() is not None,
            breaker_open=self.state.breaker() is not None,
            dry_run=self.dry_run,
        )

    def _handle(
        self, event: Event, job: JobInfo, nodes: tuple[NodeInfo, ...], now: float
    ) -> dict[str, Any]:
        policy = self.policy_for(job)
        decision_id = marks.new_decision_id()
        base: dict[str, Any] = {
            "job_id": job.job_id,
            "policy": policy.name,
            "kind": event.kind,
            "detected_ts": f"{event.ts:.3f}",
            "step": event.step,
        }
        self.metrics.detections.labels(
            kind=event.kind, cause=getattr(event, "cause", event.kind)
        ).inc()
        if not isinstance(event, StragglerEvent):
            text = f"{marks.PREFIX} {event.kind} at step {event.step} [{decision_id}]"
            self.state.save_decision(
                decision_id,
                {**base, "state": "recorded", "action": "report", "details": event.to_dict()},
            )
            self._annotate(job, text, policy)
            return {"id": decision_id, "action": "report", "kind": event.kind}
        gpus = [event.gpu] if event.scope == "gpu" and event.gpu is not None else []
        evidence, reported = gather_evidence(self.state, self.store, job.job_id, event.node, gpus)
        if is_slowdown(event, policy):  # speed-ups and small blips never enter node history
            self._remember(event, job, policy, nodes, now, corroborated=bool(evidence))
        decision = decide(event, job, policy, self._context(job), self._cluster(nodes, now), now)
        record = {
            **base,
            "node": event.node,
            "cause": event.cause,
            "scope": event.scope,
            "slowdown_pct": event.slowdown_pct,
            "score": event.score,
            "ranks": event.ranks[:32],
            "hardware_evidence": evidence,
            "job_reported_gpu": reported,
            "decision": decision.action,
            "reasons": decision.reasons,
            "saved_s": _round(decision.saved_s),
            "cost_s": _round(decision.cost_s),
        }
        mark = marks.reason(
            f"{event.cause} {event.node}",
            f"+{event.slowdown_pct:.1f}% {decision.action}",
            decision_id,
        )
        log.info(
            "service.decision",
            decision_id=decision_id,
            job_id=job.job_id,
            node=event.node,
            action=decision.action,
            reasons=decision.reasons,
        )
        if decision.action == "evict" and self._evicting(job.job_id):
            decision = replace(decision, action="none", reasons=["an eviction is in progress"])
        if decision.action == "evict":
            self._annotate(job, mark, policy)
            # Counted before acting: a crash mid-eviction must not allow one more than the max.
            self.state.update_job(
                job.job_id,
                evictions=self._context(job).evictions + 1,
                last_eviction_ts=f"{now:.3f}",
                waiting="",
            )
            outcome = self.executor.evict(decision_id, job, event.node, record)
            self.metrics.actions.labels(action="evict", outcome=outcome).inc()
            self.metrics.decision_seconds.observe(max(0.0, self.clock() - event.ts))
            return {"id": decision_id, "action": "evict", "outcome": outcome}
        if decision.action == "wait":
            self.state.save_decision(decision_id, {**record, "state": "waiting"})
            self.state.update_job(job.job_id, waiting=decision_id, waiting_since=f"{now:.3f}")
            return {"id": decision_id, "action": "wait"}
        self.state.save_decision(decision_id, {**record, "state": "recorded"})
        if decision.action == "annotate":
            self._annotate(job, mark, policy)
        return {"id": decision_id, "action": decision.action, "reasons": decision.reasons}

    def _sweep_credentials(self, known: set[str]) -> None:
        """Every 30 s: revoke per-job credentials whose job Slurm no longer lists."""
        now = self.clock()
        if not self.settings.job_credentials or now - self._last_sweep < 30.0:
            return
        self._last_sweep = now
        try:
            revoked = credentials.sweep(self.store.client, known)
        except redis.RedisError as exc:
            log.warning("service.credential_sweep_failed", error=str(exc))
            return
        if revoked:
            log.warning("service.credentials_revoked", jobs=revoked, why="job gone, no epilog")

    def _evicting(self, job_id: str) -> bool:
        """An eviction of this job is still open (its outcome not yet known)."""
        return any(
            d.get("job_id") == job_id and d.get("action") == "evict" and d.get("state") != "waiting"
            for d in self.state.open_decisions()
        )

    def _resume_waiting(
        self, job: JobInfo, nodes: tuple[NodeInfo, ...], now: float, report: CycleReport
    ) -> None:
        js = self.state.job(job.job_id)
        decision_id = js.get("waiting")
        if not decision_id:
            return
        rec = self.state.decision(decision_id)
        ctx = self._context(job)
        policy = self.policy_for(job)
        checkpointed = (ctx.last_checkpoint_ts or 0) >= (ctx.waiting_since or now)
        expired = now - (ctx.waiting_since or now) >= policy.actions.max_wait_s
        if not (checkpointed or expired):
            return
        event = StragglerEvent(
            job_id=job.job_id,
            node=rec.get("node", ""),
            gpu=None,
            ranks=[],
            step=int(rec.get("step", "0")),
            ts=now,
            score=0.0,
            slowdown_pct=float(rec.get("slowdown_pct", "0")),
            cause="compute",
            scope="gpu",
        )
        again = decide(
            event,
            job,
            policy,
            JobContext(**{**ctx.__dict__, "reports_checkpoints": False}),
            self._cluster(nodes, now),
            now,
        )
        self.state.update_job(job.job_id, waiting="")
        if again.action != "evict":
            self.state.save_decision(
                decision_id,
                {"state": "recorded", "decision": again.action, "reasons": again.reasons},
            )
            return
        outcome = self.executor.evict(
            decision_id, job, event.node, {"after": "checkpoint" if checkpointed else "max wait"}
        )
        self.state.update_job(
            job.job_id, evictions=ctx.evictions + 1, last_eviction_ts=f"{now:.3f}"
        )
        report.decisions.append({"id": decision_id, "action": "evict", "outcome": outcome})

    def _explain_prolog_drains(self, nodes: tuple[NodeInfo, ...]) -> None:
        """Nodes Slurm drained because our prolog failed get the prolog's finding as reason."""
        if self.dry_run:
            return
        for node in nodes:
            if not (node.drained and node.reason.startswith("Prolog error")):
                continue
            finding = self.state.prolog_finding(node.name)
            if not finding:
                continue
            decision_id = marks.new_decision_id()
            reason = marks.reason("prolog", finding, decision_id)
            self.executor.drain(decision_id, node.name, reason, {"was": node.reason})
            log.warning("service.prolog_drain_explained", node=node.name, reason=reason)

    def _annotate(self, job: JobInfo, text: str, policy: Policy) -> None:
        if self.dry_run or policy.actions.mode == "off" or policy.actions.notify != "comment":
            log.info("service.notify", job_id=job.job_id, text=text, notify=policy.actions.notify)
            return
        try:
            self.executor.annotate(job, text)
        except StragglerError as exc:
            log.warning("service.annotate_failed", job_id=job.job_id, error=str(exc))

    def _remember(
        self,
        event: StragglerEvent,
        job: JobInfo,
        policy: Policy,
        nodes: tuple[NodeInfo, ...],
        now: float,
        *,
        corroborated: bool = False,
    ) -> None:
        """Node history, persistent-straggler drain and the circuit breaker."""
        transition = record_incident(
            self.state.node_history(event.node),
            Incident(job.job_id, now, event.slowdown_pct, event.cause, job.user, corroborated),
            policy.persistence.params(),
            distinct_users=policy.persistence.distinct_users,
        )
        self.state.save_node_history(transition.history)
        if event.cause == "compute":
            window = policy.safety.breaker_window_s
            self._flagged = [(t, n) for t, n in self._flagged if now - t < window]
            self._flagged.append((now, event.node))
            distinct = {n for _, n in self._flagged}
            if len(distinct) > policy.safety.breaker_max_nodes and self.state.breaker() is None:
                why = (
                    f"{len(distinct)} straggler nodes within {window:.0f} s (max "
                    f"{policy.safety.breaker_max_nodes}); `straggler resume` to act again"
                )
                self.state.open_breaker(why)
                log.error("service.breaker_open", why=why)
        if not (transition.became_persistent and policy.actions.drain_persistent):
            return
        if self.dry_run or self.state.paused() or self.state.breaker():
            return
        node = next((n for n in nodes if n.name == event.node), None)
        if node is None or not node.usable:
            return
        members = [n for n in nodes if set(n.partitions) & set(node.partitions)]
        drained = sum(1 for n in members if not n.usable)
        if (drained + 1) / max(1, len(members)) > policy.safety.max_partition_drained_fraction:
            log.warning(
                "service.drain_refused", node=event.node, reason="partition drain limit reached"
            )
            return
        decision_id = marks.new_decision_id()
        reason = marks.reason("persistent", "; ".join(transition.reasons), decision_id)
        self.executor.drain(decision_id, event.node, reason, {"job_id": job.job_id})

    # -- the loop -----------------------------------------------------------------------------
    def run(self, *, once: bool = False, stop: threading.Event | None = None) -> None:
        """Cycle every ``service_interval_s`` until stopped."""
        stop = stop or threading.Event()
        while True:
            report = self.cycle()
            log.info(
                "service.cycle",
                leader=report.leader,
                jobs=report.jobs,
                records=report.records,
                events=len(report.events),
                duration_s=round(report.duration_s, 4),
                error=report.error,
            )
            if once or stop.wait(self.settings.service_interval_s):
                return


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
