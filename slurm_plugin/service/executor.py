"""Carry out decisions on Slurm, idempotently, persisting each step before the next.

Eviction: planned -> held (requeuehold) -> excluded (ExcNodeList = old + node) -> released ->
verified (Restarts went up, node excluded, job not held) or failed. The service calls
:meth:`Executor.recover` every cycle, which finishes every half-done eviction: a job we held is
always released, never left held, and never requeued twice.

When Slurm does not answer (scontrol timed out, slurmctld restarting) the outcome of a command
is unknown, so the decision stays open and is re-checked against Slurm's answer next cycle:
``planned`` becomes ``held`` once Slurm shows our requeue, or ``abandoned`` after
``unknown_grace_s`` without it; a job held for ``max_hold_s`` without its exclusion going
through is released anyway (``failed``, "released without exclusion") rather than kept held.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import structlog

from slurm_plugin.errors import CommandTimeoutError, JobNotFoundError, SlurmError
from slurm_plugin.model.cluster import HOLD_UNCLEAR, OTHERS_HOLDS, JobInfo
from slurm_plugin.service.identity import Known, describe, fields_of, same_job
from slurm_plugin.service.node_actions import NodeActions
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.slurm.scheduler import Scheduler
from slurm_plugin.store.decision import DecisionRecord

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
        unknown_grace_s: float = 60.0,
        max_hold_s: float = 120.0,
        sleep: Callable[[float], None] = time.sleep,
        step_budget_s: float | None = None,
        deployment: str | None = None,
    ) -> None:
        self.slurm = scheduler
        #: Whose marks we undo (None: any of ours, as before deployments had names).
        self.deployment = deployment
        self.state = state
        self.clock = clock
        self.verify_timeout_s = verify_timeout_s
        self.unknown_grace_s = unknown_grace_s
        self.max_hold_s = max_hold_s
        self.sleep = sleep
        #: The longest one call waits for verification (real seconds); past it the decision
        #: stays "released" and the next cycle's recover() verifies on.
        self.step_budget_s = verify_timeout_s if step_budget_s is None else step_budget_s
        self.nodes = NodeActions(
            scheduler, state, clock=clock, unknown_grace_s=unknown_grace_s, deployment=deployment
        )

    # -- eviction -------------------------------------------------------------------------------
    def evict(
        self,
        decision_id: str,
        job: JobInfo,
        nodes: str | Sequence[str],
        record: dict[str, object] | None = None,
    ) -> str:
        """Requeue ``job`` excluding ``nodes`` (one requeue for all of them); returns the final
        state. ``record`` adds the decision's context (cause, reasons, goodput) to the
        persisted decision."""
        node = (nodes,) if isinstance(nodes, str) else tuple(nodes)
        self.state.save_decision(
            decision_id,
            {
                **(record or {}),
                "state": "planned",
                "action": "evict",
                "job_id": job.job_id,
                **fields_of(job, None, prefix="job_"),  # which job: recover() checks it
                "node": node[0],
                "nodes": list(node),
                "restarts_before": job.restarts,
                "planned_at": f"{self.clock():.3f}",
            },
        )
        self.state.replicated()  # the plan outlives a failover before Slurm is touched
        try:
            self.slurm.requeue_hold(job.job_id)
        except SlurmError as exc:
            return self._hold_failed(decision_id, job, node, exc)
        held_at = self.clock()
        self.state.save_decision(decision_id, {"state": "held", "held_at": f"{held_at:.3f}"})
        return self._finish(decision_id, job.job_id, node, job.restarts, held_at)

    def _hold_failed(
        self, decision_id: str, job: JobInfo, node: tuple[str, ...], exc: SlurmError
    ) -> str:
        """requeuehold failed: a refusal Slurm answered is final; otherwise (timeout, no
        controller) the requeue may still happen, so the decision stays open for recover()."""
        try:
            now = self.slurm.job(job.job_id)
        except SlurmError:
            now = None
        if now is not None and now.hold_landed and now.restarts > job.restarts:
            held_at = self.clock()
            self.state.save_decision(
                decision_id,
                {"state": "held", "held_at": f"{held_at:.3f}", "note": f"requeuehold: {exc}"},
            )
            return self._finish(decision_id, job.job_id, node, job.restarts, held_at)
        if now is not None and now.running and not _timed_out(exc):
            self.state.save_decision(
                decision_id, {"state": "failed", "error": f"requeuehold: {exc}"}
            )
            self.state.uncount_eviction(job.job_id)
            return "failed"
        self.state.save_decision(
            decision_id, {"error": f"requeuehold: {exc} (outcome unknown; re-checked)"}
        )
        return "pending"

    def _finish(
        self,
        decision_id: str,
        job_id: str,
        node: tuple[str, ...],
        restarts_before: int,
        held_at: float,
    ) -> str:
        """From 'held' on: exclude (merging old exclusions), release, verify."""
        error = None
        comment = None
        try:
            current = self.slurm.job(job_id)
            comment = current.admin_comment
            excluded = sorted({*current.excluded, *node})
            if not set(node) <= set(current.excluded):
                self.slurm.set_excluded(job_id, excluded)
            self.state.save_decision(decision_id, {"state": "excluded", "excluded": excluded})
        except SlurmError as exc:
            if self.clock() - held_at < self.max_hold_s:
                self.state.save_decision(decision_id, {"error": f"exclude: {exc} (retrying)"})
                return "pending"
            error = f"exclude: {exc}; released without exclusion after {self.max_hold_s:g} s"
        try:
            other = self._held_by_another(job_id)
            if other is not None:  # our release landed after all, and someone held it since
                self.state.save_decision(decision_id, {"note": other})
                return self._verify(decision_id, job_id, node, restarts_before, self.clock())
            self.slurm.release(job_id)  # idempotent: harmless on a job that is not held
        except SlurmError as exc:
            # Never give up on a job we hold: the decision stays open, recover() retries.
            self.state.save_decision(decision_id, {"error": f"release: {exc} (retrying)"})
            log.warning("executor.release_failed", decision_id=decision_id, error=str(exc))
            return "pending"
        released_at = self.clock()
        self.state.save_decision(
            decision_id, {"state": "released", "released_at": f"{released_at:.3f}"}
        )
        self._mark_released(job_id, decision_id, comment)
        if error:
            self.state.save_decision(decision_id, {"state": "failed", "error": error})
            return "failed"
        return self._verify(decision_id, job_id, node, restarts_before, released_at)

    def _verify(
        self,
        decision_id: str,
        job_id: str,
        node: tuple[str, ...],
        restarts_before: int,
        released_at: float,
    ) -> str:
        """Released -> verified once Slurm shows the job running again without ``node`` (each);
        failed when it does not within ``verify_timeout_s`` of the release."""
        deadline = released_at + self.verify_timeout_s
        budget_end = time.monotonic() + self.step_budget_s
        detail = "no answer"
        while True:
            answered = False
            try:
                job = self.slurm.job(job_id)
                answered = True
                # What we did, as Slurm shows it: requeued, the node excluded, not held. A job
                # still pending after that (Slurm's requeue delay, a busy partition: 83 s under
                # load) is no failure of ours.
                other = self._held_by_another(job_id) if job.hold_landed else None
                ok = (
                    set(node) <= set(job.excluded)
                    and job.restarts > restarts_before
                    and (not job.hold_landed or other is not None)
                    and not set(node) & set(job.nodes)
                )
                if job.hold_landed and other is None:  # our release did not take, came early
                    self.slurm.release(job_id)
                detail = (
                    f"state={job.state} restarts={job.restarts} "
                    f"excluded={','.join(job.excluded)} nodes={','.join(job.nodes)}"
                    + (f"; {other}" if other else "")
                )
                if ok:
                    self.state.save_decision(decision_id, {"state": "verified", "verified": detail})
                    log.info(
                        "executor.evicted",
                        decision_id=decision_id,
                        job_id=job_id,
                        node=",".join(node),
                    )
                    return "verified"
            except SlurmError as exc:
                detail = str(exc)
            if self.clock() >= deadline:
                if not answered:  # Slurm away: verify again next cycle
                    self.state.save_decision(decision_id, {"error": f"verify: {detail}"})
                    return "pending"
                self.state.save_decision(
                    decision_id, {"state": "failed", "error": f"verify: {detail}"}
                )
                return "failed"
            if time.monotonic() >= budget_end:  # go on next cycle, from that cycle's answer
                return "pending"
            self.sleep(0.5)

    def recover(self) -> list[str]:
        """Finish or close every decision a previous service (or cycle) left open."""
        done = []
        for rec in self.state.open_records():
            if rec.action in {"drain", "resume"}:
                finished = self.nodes.recover(rec) != "pending"
            elif rec.action == "release":
                finished = self._recover_release(rec)
            elif rec.action == "evict" and rec.state != "waiting":
                finished = self._recover_eviction(rec)
            else:
                continue
            if finished:
                done.append(rec.id)
        return done

    def _recover_eviction(self, rec: DecisionRecord) -> bool:
        decision_id, state = rec.id, rec.state or ""
        job_id, node = rec.job_id or "", tuple(rec.nodes or [rec.node or ""])
        before = rec.restarts_before or 0
        log.warning("executor.recovering", decision_id=decision_id, job_id=job_id, state=state)
        try:
            job = self.slurm.job(job_id)
        except SlurmError as exc:
            if isinstance(exc, JobNotFoundError):
                self.state.save_decision(
                    decision_id, {"state": "failed", "error": f"recover: {exc}"}
                )
                return True
            self.state.save_decision(decision_id, {"error": f"recover: {exc}"})  # next cycle
            return False
        if self._abandoned_as_another_job(rec, job):
            return True
        now = self.clock()
        # A job still completing into our hold counts as held: its requeue landed (Slurm shows
        # it so for seconds after a slurmctld restart that caught it mid-way).
        if state == "planned" and not (job.hold_landed and job.restarts > before):
            # An scontrol started before a crash or timeout may still land: wait a while.
            if now - (rec.planned_at or now) < self.unknown_grace_s:
                return False
            # requeuehold never happened: nothing to undo; detection will speak again.
            self.state.save_decision(
                decision_id,
                {"state": "abandoned", "error": rec.error or "stopped before acting"},
            )
            self.state.uncount_eviction(job_id)
        elif state == "released":
            self._verify(decision_id, job_id, node, before, rec.released_at or now)
        else:  # planned (held by us), held or excluded
            if state == "planned":  # our requeuehold landed after all: held from now on
                held_at = now
                self.state.save_decision(
                    decision_id, {"state": "held", "held_at": f"{now:.3f}", "recovered": "yes"}
                )
            else:
                held_at = rec.held_at or now
            self._finish(decision_id, job_id, node, before, held_at)
        return True

    def release_orphans(self, jobs: Sequence[JobInfo]) -> list[str]:
        """Slurm is the source of truth for what we did to it: a job held with our eviction
        mark whose decision Redis does not know (a restart without persistence lost it) is
        released, never left held, and the release audited (read back: ``verified`` once
        Slurm shows it not held; recover() tries again until then). A known decision is
        recover()'s; a hold without our eviction mark is someone else's and left alone."""
        released = []
        why = "which Redis does not know (lost in a restart?): released rather than left held"
        releasing = {d.of for d in self.state.open_records() if d.action == "release"}
        for job in jobs:
            if not job.held:
                continue
            found = marks.eviction_of(job.admin_comment, self.deployment)
            if found is None or found[1] or found[0] in releasing:  # released: not held by us
                continue
            ours = found[0]
            known = self.state.record(ours)
            reasons = [f"held with our eviction mark {ours}, {why}"]
            if known.state is not None:
                late = _landed_late(ours, known, job)
                if late is None:
                    continue  # recover()'s, or done with
                reasons = [late]
            decision_id = marks.new_decision_id()
            if known.state is not None:
                self.state.save_decision(ours, {"landed_late": decision_id})
            self.state.save_decision(
                decision_id,
                {
                    "state": "planned",
                    "action": "release",
                    "job_id": job.job_id,
                    **fields_of(job, None, prefix="job_"),
                    "of": ours,
                    "by": "reconcile",
                    "reasons": reasons,
                    "planned_at": f"{self.clock():.3f}",
                },
            )
            log.warning("executor.orphan_released", job_id=job.job_id, decision_id=ours)
            self._release_and_check(decision_id, job.job_id)
            released.append(job.job_id)
        return released

    def _abandoned_as_another_job(self, rec: DecisionRecord, job: JobInfo) -> bool:
        """True (and the decision abandoned) when Slurm gave the decision's job id to another
        job (controller reinstalled, MaxJobId wrapped): whatever the old job's action left
        undone, this job is never touched."""
        if rec.job_user is None:
            return False
        known = Known(
            rec.job_user,
            rec.job_submit_ts,
            rec.job_restarts or 0,
            rec.job_first_submit_ts,
            rec.job_sluid or None,
        )
        if same_job(known, job):
            return False
        self.state.save_decision(
            rec.id,
            {
                "state": "abandoned",
                "error": f"job id {job.job_id} is now another job ({describe(job)}): "
                "nothing done to it",
            },
        )
        log.warning("executor.job_id_reused", decision_id=rec.id, job_id=job.job_id)
        return True

    def _held_by_another(self, job_id: str) -> str | None:
        """Why the job is not ours to release when its user or an admin holds it (after a
        release of ours, one that timed out included); None when our requeuehold holds it
        (or Slurm names no other's hold). :class:`SlurmError` when Slurm does not answer."""
        reason = self.slurm.hold_reason(job_id)
        if reason == HOLD_UNCLEAR:
            return (
                "its hold cannot be told ours (the job's own name, comment or submit line "
                "names a hold reason too): not released, left held for its user or an admin"
            )
        if reason not in OTHERS_HOLDS:
            return None
        return f"held by its user or an admin since ({reason}): not ours to release, left held"

    def _release_and_check(self, decision_id: str, job_id: str) -> bool:
        """Release, then read back: True once Slurm shows the job not held (or held by its
        user or an admin: then never released by us, the decision abandoned)."""
        try:
            other = self._held_by_another(job_id)
            if other is not None:
                self.state.save_decision(decision_id, {"state": "abandoned", "error": other})
                log.warning("executor.hold_not_ours", decision_id=decision_id, job_id=job_id)
                return True
            self.slurm.release(job_id)
            job = self.slurm.job(job_id)
        except SlurmError as exc:  # told or not, the next cycle reads it back and retries
            self.state.save_decision(decision_id, {"error": f"release: {exc} (re-checked)"})
            return False
        if job.held:
            self.state.save_decision(decision_id, {"error": "still held after release"})
            return False
        self.state.save_decision(decision_id, {"state": "verified", "verified": job.state})
        return True

    def _recover_release(self, rec: DecisionRecord) -> bool:
        decision_id, job_id = rec.id, rec.job_id or ""
        try:
            job = self.slurm.job(job_id)
        except JobNotFoundError:
            self.state.save_decision(decision_id, {"state": "abandoned", "error": "job gone"})
            return True
        except SlurmError as exc:
            self.state.save_decision(decision_id, {"error": f"recover: {exc}"})
            return False
        if self._abandoned_as_another_job(rec, job):
            return True
        if not job.held:
            self.state.save_decision(decision_id, {"state": "verified", "verified": job.state})
            return True
        return self._release_and_check(decision_id, job_id)

    def _mark_released(self, job_id: str, decision_id: str, comment: str | None) -> None:
        """Our eviction mark on the job becomes "evicted": a later hold of the job (its user's,
        an admin's) is then never taken for one of ours that Redis forgot (release_orphans).
        ``comment``: the job's AdminComment as read before the release (None: read it)."""
        try:
            own = self.slurm.job(job_id).admin_comment if comment is None else comment
            if f" evict [{decision_id}" in own:
                self.slurm.annotate(
                    job_id, own.replace(f" evict [{decision_id}", f" evicted [{decision_id}")
                )
        except SlurmError as exc:  # the release stands; only a forgetful Redis would need it
            log.warning("executor.mark_not_updated", job_id=job_id, error=str(exc))

    # -- marks ------------------------------------------------------------------------------------
    def annotate(self, job: JobInfo, text: str) -> str:
        """Put our mark in the job's AdminComment, keeping anyone else's text; read back:
        "verified" when Slurm shows it, "failed" when Slurm shows something else (a timeout
        that did not land included), "unknown" when Slurm did not answer the read."""
        own = job.admin_comment
        if own and not marks.is_ours(own, self.deployment):
            keep = own.split(" | straggler:")[0]
            text = f"{keep} | {text}"
        wanted = text[:250]
        try:
            self.slurm.annotate(job.job_id, wanted)
        except SlurmError as exc:
            if not _timed_out(exc):
                raise
        try:
            shown = self.slurm.job(job.job_id).admin_comment
        except SlurmError:
            return "unknown"
        return "verified" if shown == wanted else "failed"

    def drain(
        self,
        decision_id: str,
        node: str,
        reason: str,
        record: dict[str, object] | None = None,
        *,
        persistent: bool = False,
    ) -> str:
        """Drain ``node`` with our reason, read back from Slurm (service/node_actions.py); a
        ``persistent`` straggler's is refused by the prolog from before the call."""
        return self.nodes.drain(decision_id, node, reason, record, persistent=persistent)

    def resume_ours(self, node: str, reason: str, decision_id: str) -> bool:
        """Resume ``node`` only when its drain reason is ours; True when Slurm shows it."""
        return self.nodes.resume(node, reason, decision_id)


def _landed_late(decision_id: str, decision: DecisionRecord, job: JobInfo) -> str | None:
    """Why a held job whose eviction decision Redis knows is ours to release: the decision
    was given up (its requeuehold timed out, then landed later: slurmctld under load), so
    nobody else will. None when it is not (open, verified, released once already)."""
    if decision.action != "evict" or decision.landed_late:
        return None
    if decision.state not in {"abandoned", "failed"}:
        return None
    if job.restarts <= (decision.restarts_before or 0):
        return None
    return (
        f"held by our eviction {decision_id}, given up as "
        f"{decision.state} before its requeue landed: released rather than left held"
    )


def _timed_out(exc: SlurmError) -> bool:
    return isinstance(exc.__cause__, CommandTimeoutError)
