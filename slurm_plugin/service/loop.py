"""``straggler serve``: read telemetry, detect, decide, act, verify, audit — every cycle.

One instance leads (a Redis lock); others wait as hot standbys. Policies are re-read every
cycle and the last good set is kept when a file breaks. A failing cycle is logged with its
context and the next one runs anyway.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis
import structlog

from slurm_plugin.config import Settings
from slurm_plugin.detection import DetectionParams, Detector, Event, StragglerEvent
from slurm_plugin.errors import StragglerError
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.policy import lifecycle
from slurm_plugin.policy.decide import ClusterContext, is_node_slow, is_slowdown
from slurm_plugin.policy.history import other_jobs
from slurm_plugin.policy.schema import Policy
from slurm_plugin.service.collector import BetweenCycles
from slurm_plugin.service.decisions import Decisions
from slurm_plugin.service.detectors import Detectors
from slurm_plugin.service.evidence import gather_evidence
from slurm_plugin.service.executor import Executor
from slurm_plugin.service.fence import FencedScheduler
from slurm_plugin.service.hooks import NodeHooks
from slurm_plugin.service.identity import Identities
from slurm_plugin.service.ingest import Ingest
from slurm_plugin.service.metrics import Metrics
from slurm_plugin.service.node_rails import NodeRails
from slurm_plugin.service.policies import PolicySet
from slurm_plugin.service.state import ServiceState
from slurm_plugin.service.value import Value
from slurm_plugin.service.waiting import probe
from slurm_plugin.slurm import marks
from slurm_plugin.slurm.scheduler import Scheduler
from slurm_plugin.store.job_state import JobState
from slurm_plugin.store.telemetry_store import TelemetryStore

log = structlog.get_logger(__name__)

#: Cycles failing in a row after which a leader gives its lock up (a standby may do better).
STEP_DOWN_AFTER = 3
#: Detection runs until the cycle has taken this share of the interval, and at least
#: DETECT_MIN_SHARE of it after the reads: past that, the jobs whose steps waited longest go
#: first and the others wait for the next cycle (Detector.advance), but never longer than
#: DETECT_MAX_WAIT_S (then the cycle takes longer). Small jobs of one layout are run together
#: (detection/many.py: 2,000 jobs of 8 ranks in ~0.2 s), so the deadline is reached only when
#: many jobs need the per-job detector at once (their warm-ups end, they alarm).
CYCLE_SHARE = 0.45
DETECT_MIN_SHARE = 0.1
DETECT_MAX_WAIT_S = 30.0


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
        detector: Callable[[DetectionParams], Detector] = Detector,
    ) -> None:
        self.settings = settings
        self.state = state
        self.store = store
        self.dry_run = dry_run
        self.clock = clock
        # The lock names the deployment: `straggler status` tells two that share a Slurm.
        self.instance = instance or f"{settings.deployment}/{socket.gethostname()}:{os.getpid()}"
        self.metrics = metrics or Metrics()
        self.lock_ttl_s = lock_ttl_s or max(10.0, 5 * settings.service.interval_s)
        # Every Slurm-changing call confirms the lock first (the fence), and no step of a cycle
        # waits on Slurm for more than a quarter of the lock's life (verification goes on in
        # the next cycle), so a stalled instance cannot act next to the new leader.
        self.slurm = FencedScheduler(scheduler, lambda: self.state.leads(self.instance))
        self.executor = Executor(
            self.slurm,
            state,
            clock=clock,
            unknown_grace_s=settings.service.action_grace_s,
            step_budget_s=self.lock_ttl_s / 4,
            deployment=settings.deployment,
        )
        self._policies = PolicySet(settings, state)
        self._collector = BetweenCycles()
        self._ingest = Ingest(state, store, self.metrics)
        self._value = Value(self.metrics)
        self._identities = Identities(state, store, settings.deployment, clock)
        self._detectors = Detectors(
            detector, state, self._identities, settings.rails.persistence, clock
        )
        self._node_rails = NodeRails(state, self.executor, dry_run=dry_run)
        self.hooks = NodeHooks(settings.hooks, state, settings.deployment, dry_run=dry_run)
        self._decisions = Decisions(
            state,
            self.executor,
            self.metrics,
            self._value,
            clock,
            recovery=self._ingest.recovery,
            dry_run=dry_run,
        )
        self._failures = 0  # cycles failed in a row
        self._standby_until = 0.0  # after stepping down: do not take the lock before this
        #: The cluster-wide rails: the service's settings, never a job's policy.
        self.rails = settings.rails

    # -- policies ---------------------------------------------------------------------------
    def reload_policies(self) -> None:
        """Re-read the policies (:meth:`PolicySet.reload`)."""
        self._policies.reload()

    def policy_for(self, job: JobInfo) -> Policy:
        """The job's policy (:meth:`PolicySet.for_job`)."""
        return self._policies.for_job(job)

    # -- one cycle ----------------------------------------------------------------------------
    def cycle(self) -> CycleReport:
        """One pass; never raises (the error is in the report and the log)."""
        started = time.monotonic()
        report = CycleReport()
        try:
            with self._collector.cycle():
                self._cycle(report)
            self._failures = 0
        except Exception as exc:  # the loop boundary: one bad cycle never stops the next
            where = "Redis " if isinstance(exc, redis.RedisError) else ""
            report.error = f"{where}{type(exc).__name__}: {exc}"
            self.metrics.errors.labels(system=type(exc).__name__).inc()
            if isinstance(exc, StragglerError | redis.RedisError):  # Slurm or Redis away
                log.error("service.cycle_failed", error=report.error)  # noqa: TRY400
            else:  # a bug: the traceback is for us
                log.exception("service.cycle_failed", error=report.error)
            self._failures += 1
            if self._failures >= STEP_DOWN_AFTER:  # a broken leader never blocks a standby
                with contextlib.suppress(redis.RedisError):
                    if self.state.step_down(self.instance):
                        log.error("service.stepped_down", failures=self._failures)  # noqa: TRY400
                # Stand by for two lock lives: a healthy standby takes over meanwhile.
                self._standby_until = time.monotonic() + 2 * self.lock_ttl_s
        with contextlib.suppress(redis.RedisError):
            self._value.service(report.leader, self.state)
        report.duration_s = time.monotonic() - started
        self.metrics.cycle_seconds.observe(report.duration_s)
        return report

    def _cycle(self, report: CycleReport) -> None:
        started = time.monotonic()
        now = self.clock()
        if time.monotonic() < self._standby_until:
            return
        report.leader = self.state.lead(self.instance, ttl_s=self.lock_ttl_s)
        if not report.leader:
            return
        self.reload_policies()
        # Every cycle, not only after a restart: actions whose outcome Slurm did not tell us
        # (timeouts, a restarting slurmctld) are finished as soon as it answers again.
        self.executor.recover()
        jobs = self.slurm.jobs()
        if not self.dry_run:
            self.executor.release_orphans(jobs)
        if (
            self.settings.telemetry.job_credentials
        ):  # only from Slurm's answer: silence revokes nothing
            self._ingest.sweep_credentials({j.job_id for j in jobs}, self.clock())
        running = {j.job_id: j for j in jobs if j.running}
        self._identities.restore_waiting(jobs)
        nodes = tuple(self.slurm.nodes())
        self._forget_jobs(running)
        # Every running job's state (as the identity check read and left it), registration
        # and new telemetry in a few round trips.
        known = self._identities.states
        self._policies.prefetch(running.values())
        # One policy per job and cycle: its detection, its decisions and its waiting decision's
        # tick all read the same one.
        policies = {job_id: self.policy_for(job) for job_id, job in running.items()}
        self._read_telemetry(running, policies, report)
        events: list[Event] = []
        interval = self.settings.service.interval_s
        deadline = max(
            started + interval * CYCLE_SHARE, time.monotonic() + interval * DETECT_MIN_SHARE
        )
        for detector in self._detectors.all():
            events += detector.advance(deadline=deadline, max_wait_s=DETECT_MAX_WAIT_S)
            events += detector.check_hangs(now, only=list(running))
        handled = set()
        for event in events:
            target = running.get(event.job_id)
            if target is not None:
                handled.add(event.job_id)
                report.events.append(event.to_dict())
                policy = policies[event.job_id]
                report.decisions.append(self._handle(event, target, policy, nodes, now, events))
        for job in running.values():
            self._ingest.note_structure(job, self._detectors.all())
            if job.job_id in handled or known[job.job_id].waiting:
                self._tick(job, policies[job.job_id], nodes, now, report)
        self._node_rails.explain_prolog_drains(nodes)
        self._node_rails.age(now, self.rails)
        self.hooks.tick()  # starts the next node hook, if any; never waits for one
        waited = max((d.waiting_s() for d in self._detectors.all()), default=0.0)
        self.metrics.jobs.set(report.jobs)
        self.metrics.ranks.set(report.ranks)
        self.metrics.detect_waiting.set(waited)
        self.state.heartbeat(
            self.instance,
            {
                "jobs": report.jobs,
                "ranks": report.ranks,
                "records": report.records,
                "detection_wait_s": round(waited, 1),
            },
        )

    def _read_telemetry(
        self, running: dict[str, JobInfo], policies: dict[str, Policy], report: CycleReport
    ) -> None:
        """Every watched job's new telemetry into its detector (a job whose policy is off is
        not watched), counted in ``report``."""
        watched = [
            (job, self._detectors.for_job(job, policies[job_id]))
            for job_id, job in running.items()
            if policies[job_id].actions.mode != "off"
        ]
        for job_id, (kept, ignored) in self._ingest.read(watched, self._identities.states).items():
            self._value.saw(job_id, kept.ranks)
            report.records += kept.records
            report.ranks += kept.ranks
            report.ignored_records += ignored
        report.jobs = len(self._detectors.jobs())

    def _forget_jobs(self, running: dict[str, JobInfo]) -> None:
        """Drop what is kept for jobs that stopped running, and for ids Slurm now gives
        another job (service/identity.py)."""
        reused = set(self._identities.check(running.values()))
        for job_id in self._detectors.jobs():
            if job_id not in running or job_id in reused:
                self._detectors.forget(job_id)
        for job_id in reused:
            self._ingest.forget(job_id)
            self._policies.forget(job_id)
        self._ingest.forget_all_but(running)
        self._value.forget_all_but(set(running) - reused)
        self._decisions.ended(set(running) - reused)

    # -- decisions ----------------------------------------------------------------------------
    def _cluster(self, nodes: tuple[NodeInfo, ...], now: float) -> ClusterContext:
        return ClusterContext(
            nodes=nodes,
            evictions_last_hour=self.state.evictions_since(now - 3600),
            paused=self.state.paused() is not None,
            breaker_open=self.state.breaker() is not None,
            dry_run=self.dry_run,
            safety=self.rails.safety,
        )

    def _handle(
        self,
        event: Event,
        job: JobInfo,
        policy: Policy,
        nodes: tuple[NodeInfo, ...],
        now: float,
        cycle: Sequence[Event] = (),
    ) -> dict[str, Any]:
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
            tag = marks.tag(decision_id, self.executor.deployment or "")
            text = f"{marks.PREFIX} {event.kind} at step {event.step} {tag}"
            self.state.save_decision(
                decision_id,
                {**base, "state": "recorded", "action": "report", "details": event.to_dict()},
            )
            self._decisions.annotated(decision_id, job, text, policy)
            return {"id": decision_id, "action": "report", "kind": event.kind}
        gpus = [event.gpu] if event.scope == "gpu" and event.gpu is not None else []
        evidence = gather_evidence(
            self.state,
            self.store,
            job.job_id,
            event.node,
            gpus,
            time.time(),  # the sidecar stamps samples with the wall clock
            self.settings.service.evidence_max_age_s,
        )
        past = self._node_incidents(event.node, job, now)
        if is_node_slow(event, policy):  # speed-ups and small blips never enter node history
            self._node_rails.remember(
                event,
                job,
                self._identities.token(job),
                self.rails,
                nodes,
                now,
                corroborated=bool(evidence[0]),
                cluster_mode=self._policies.default.actions.mode,
                costless=not is_slowdown(event, policy),
            )
        job_state = self.state.job_state(job.job_id)
        held = self._decisions.waiting(job_state)
        world = self._world(job, job_state, policy, nodes, now)

        def peers() -> tuple[lifecycle.Candidate, ...]:
            def incidents(node: str) -> int:
                return self._node_incidents(node, job, now)

            return lifecycle.peers_of(event, cycle, policy, incidents)

        world = replace(world, peers=peers)
        state, effects, decision = lifecycle.detected(held, event, past, decision_id, world)
        if is_slowdown(event, policy):
            self._value.straggling(event, decision)
        log.info(  # once, the verdict
            "service.decision",
            decision_id=decision_id,
            job_id=job.job_id,
            node=event.node,
            action=decision.action,
            reasons=decision.reasons,
        )
        done = self._carry_out(effects, job, policy, nodes, now, base, evidence)
        if done:
            return done[-1]
        waiting = state.decision_id if state is not None else decision_id
        return {"id": waiting, "action": "wait", "reasons": ["still waiting"]}

    def _world(
        self,
        job: JobInfo,
        job_state: JobState,
        policy: Policy,
        nodes: tuple[NodeInfo, ...],
        now: float,
    ) -> lifecycle.World:
        """The facts of now about ``job`` (``job_state``: its service state, read once), for
        the decision lifecycle; whether an eviction is open is looked up only if a verdict
        to evict asks."""
        return lifecycle.World(
            job,
            policy,
            job_state.context(),
            self._cluster(nodes, now),
            now,
            probe(self._detectors.of, job, policy.detection.min_slowdown_pct),
            evicting=lambda: self._decisions.evicting(job.job_id),
            advised=job_state.advised(),
            acted=job_state.acted(),
        )

    def _tick(
        self,
        job: JobInfo,
        policy: Policy,
        nodes: tuple[NodeInfo, ...],
        now: float,
        report: CycleReport,
    ) -> None:
        """The job's waiting decision decided again if what it waits for came."""
        job_state = self.state.job_state(job.job_id)
        held = self._decisions.waiting(job_state)
        if held is None:
            return
        _, effects = lifecycle.tick(held, self._world(job, job_state, policy, nodes, now))
        if any(isinstance(e, lifecycle.Close) and e.acted for e in effects):
            self._regrouped(job.job_id)
        report.decisions += [
            d
            for d in self._carry_out(effects, job, policy, nodes, now)
            if d.get("action") == "evict"
        ]

    def _carry_out(
        self,
        effects: Sequence[lifecycle.Effect],
        job: JobInfo,
        policy: Policy,
        nodes: tuple[NodeInfo, ...],
        now: float,
        base: dict[str, Any] | None = None,
        evidence: tuple[list[str], list[str]] = ([], []),
    ) -> list[dict[str, Any]]:
        """The lifecycle's effects carried out; each eviction that Slurm did not refuse goes
        into its nodes' history as an incident of the job, however short the slowdown (the
        job paid a requeue for it; the backtest records it the same way)."""
        done = self._decisions.carry_out(effects, job, policy, now, base, evidence)
        if self.dry_run:
            return done
        kept = {d["id"] for d in done if d.get("action") == "evict" and d["outcome"] != "failed"}
        for effect in effects:
            if not isinstance(effect, lifecycle.Evict) or effect.decision_id not in kept:
                continue
            for node in effect.nodes:
                self._node_rails.remember(
                    effect.event_on(node),
                    job,
                    self._identities.token(job),
                    self.rails,
                    nodes,
                    now,
                    cluster_mode=self._policies.default.actions.mode,
                    evicted=True,
                )
        return done

    def _regrouped(self, job_id: str) -> None:
        """The job left nodes on advice and re-forms its ranks without them (torch elastic
        numbers them anew): its ranks may move to other nodes, and its detector learns the
        new group from scratch."""
        self._ingest.evidence.regrouped(job_id)
        detector = self._detectors.of(job_id)
        if detector is not None:
            detector.forget(job_id)

    def _node_incidents(self, node: str, job: JobInfo, now: float) -> int:
        """Other jobs that saw ``node`` slow within ``recent_days`` (the goodput
        rule's prior that a slowdown there is a fault)."""
        params = self.rails.persistence.params()
        return other_jobs(self.state.node_history(node), self._identities.token(job), now, params)

    # -- the loop -----------------------------------------------------------------------------
    def run(self, *, once: bool = False, stop: threading.Event | None = None) -> CycleReport:
        """Cycle every ``service.interval_s`` until stopped; returns the last cycle's report."""
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
            if once or stop.wait(self.settings.service.interval_s):
                return report
