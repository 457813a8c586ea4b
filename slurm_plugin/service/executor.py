"""Carry out decisions on Slurm, idempotently, persisting each step before the next.

Eviction: planned -> held (requeuehold) -> excluded (ExcNodeList = old + node) -> released ->
verified (Restarts went up, node excluded, job not held) or failed. A restarted service calls
:meth:`Executor.recover`, which finishes every half-done eviction: a job we held is always
released, never left held, and never requeued twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from slurm_plugin.errors import SlurmError
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.slurm.model import JobInfo
from slurm_plugin.slurm.scheduler import Scheduler

log = structlog.get_logger(__name__)


class Executor:
    """Acts on Slurm for the service."""

    def __init__(
        self,
        scheduler: Scheduler,
        state: ServiceState,
        *,
        clock: Callable[[], float] = time.time,
        verify_timeout_s: float = 20.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.slurm = scheduler
        self.state = state
        self.clock = clock
        self.verify_timeout_s = verify_timeout_s
        self.sleep = sleep

    # -- eviction -------------------------------------------------------------------------------
    def evict(
        self, decision_id: str, job: JobInfo, node: str, record: dict[str, object] | None = None
    ) -> str:
        """Requeue ``job`` excluding ``node``; returns the final state. ``record`` adds the
        decision's context (cause, reasons, goodput) to the persisted decision."""
        self.state.save_decision(
            decision_id,
            {
                **(record or {}),
                "state": "planned",
                "action": "evict",
                "job_id": job.job_id,
                "node": node,
                "restarts_before": job.restarts,
            },
        )
        try:
            self.slurm.requeue_hold(job.job_id)
        except SlurmError as exc:
            self.state.save_decision(
                decision_id, {"state": "failed", "error": f"requeuehold: {exc}"}
            )
            return "failed"
        self.state.save_decision(decision_id, {"state": "held"})
        return self._finish(decision_id, job.job_id, node, job.restarts)

    def _finish(self, decision_id: str, job_id: str, node: str, restarts_before: int) -> str:
        """From 'held' on: exclude (merging old exclusions), release, verify."""
        error = None
        try:
            current = self.slurm.job(job_id)
            excluded = sorted({*current.excluded, node})
            if node not in current.excluded:
                self.slurm.set_excluded(job_id, excluded)
            self.state.save_decision(decision_id, {"state": "excluded", "excluded": excluded})
        except SlurmError as exc:
            error = f"exclude: {exc}"
        try:
            self.slurm.release(job_id)  # idempotent: harmless on a job that is not held
            self.state.save_decision(decision_id, {"state": "released"})
        except SlurmError as exc:
            error = error or f"release: {exc}"
            self.state.save_decision(decision_id, {"state": "failed", "error": error})
            log.exception(
                "executor.release_failed", decision_id=decision_id, job_id=job_id, error=str(exc)
            )
            return "failed"
        if error:
            self.state.save_decision(decision_id, {"state": "failed", "error": error})
            return "failed"
        return self._verify(decision_id, job_id, node, restarts_before)

    def _verify(self, decision_id: str, job_id: str, node: str, restarts_before: int) -> str:
        deadline = self.clock() + self.verify_timeout_s
        detail = "no answer"
        while True:
            try:
                job = self.slurm.job(job_id)
                ok = (
                    node in job.excluded
                    and job.restarts > restarts_before
                    and not job.held
                    and node not in job.nodes
                )
                detail = (
                    f"state={job.state} restarts={job.restarts} "
                    f"excluded={','.join(job.excluded)} nodes={','.join(job.nodes)}"
                )
                if ok:
                    self.state.save_decision(decision_id, {"state": "verified", "verified": detail})
                    log.info("executor.evicted", decision_id=decision_id, job_id=job_id, node=node)
                    return "verified"
            except SlurmError as exc:
                detail = str(exc)
            if self.clock() >= deadline:
                self.state.save_decision(
                    decision_id, {"state": "failed", "error": f"verify: {detail}"}
                )
                return "failed"
            self.sleep(0.5)

    def recover(self) -> list[str]:
        """Finish or close every decision a previous service left open."""
        done = []
        for rec in self.state.open_decisions():
            decision_id, state = rec["id"], rec.get("state", "")
            job_id, node = rec.get("job_id", ""), rec.get("node", "")
            if state == "waiting" or rec.get("action") != "evict":
                continue
            before = int(rec.get("restarts_before", "0") or 0)
            log.warning("executor.recovering", decision_id=decision_id, job_id=job_id, state=state)
            try:
                job = self.slurm.job(job_id)
            except SlurmError as exc:
                self.state.save_decision(
                    decision_id, {"state": "failed", "error": f"recover: {exc}"}
                )
                continue
            if state == "planned" and not (job.held and job.restarts > before):
                # requeuehold never happened: nothing to undo; detection will speak again.
                self.state.save_decision(
                    decision_id, {"state": "abandoned", "error": "service stopped before acting"}
                )
            elif state == "released":
                self._verify(decision_id, job_id, node, before)
            else:  # planned (held by us), held or excluded
                self.state.save_decision(decision_id, {"state": "held", "recovered": "yes"})
                self._finish(decision_id, job_id, node, before)
            done.append(decision_id)
        return done

    # -- marks ------------------------------------------------------------------------------------
    def annotate(self, job: JobInfo, text: str) -> None:
        """Put our mark in the job's AdminComment, keeping anyone else's text."""
        own = job.admin_comment
        if own and not marks.is_ours(own):
            keep = own.split(" | straggler:")[0]
            text = f"{keep} | {text}"
        self.slurm.annotate(job.job_id, text[:250])

    def drain(
        self, decision_id: str, node: str, reason: str, record: dict[str, object] | None = None
    ) -> str:
        """Drain ``node`` with our reason (persisted first)."""
        self.state.save_decision(
            decision_id,
            {
                **(record or {}),
                "state": "planned",
                "action": "drain",
                "node": node,
                "reason": reason,
            },
        )
        try:
            self.slurm.drain(node, reason)
        except SlurmError as exc:
            self.state.save_decision(decision_id, {"state": "failed", "error": str(exc)})
            return "failed"
        self.state.save_decision(decision_id, {"state": "verified"})
        return "verified"

    def resume_ours(self, node: str, reason: str, decision_id: str) -> bool:
        """Resume ``node`` only when its drain reason is ours; True when resumed."""
        if not marks.is_ours(reason):
            return False
        self.slurm.resume(node)
        self.state.save_decision(
            decision_id, {"state": "verified", "action": "resume", "node": node, "was": reason}
        )
        return True
