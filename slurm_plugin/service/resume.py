"""A waiting decision decided again: at the job's checkpoint, once ``max_wait_s`` has passed,
after a pause or the breaker lifted, or a cycle after a re-check had nothing to look at. Of
the nodes flagged while waiting, the one slowest in the newest steps is taken out, if it is
still slow and the policy still says so."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import structlog

from slurm_plugin.detection import StragglerEvent
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.policy.decide import decide
from slurm_plugin.policy.verdict import Facts, final
from slurm_plugin.service.record import number
from slurm_plugin.service.waiting import candidates
from slurm_plugin.slurm import marks

if TYPE_CHECKING:
    from slurm_plugin.service.loop import CycleReport, Service

log = structlog.get_logger(__name__)


def resume_waiting(
    svc: Service, job: JobInfo, nodes: tuple[NodeInfo, ...], now: float, report: CycleReport
) -> None:
    decision_id = svc._waiting(job)
    if not decision_id:
        return
    rec = svc.state.decision(decision_id)
    ctx = svc._context(job)
    policy = svc.policy_for(job)
    waiting_for = rec.get("waiting_for")
    if waiting_for in {"resume", "recheck"}:  # a pause or the breaker; a re-check unsure
        if waiting_for == "resume" and (svc.state.paused() or svc.state.breaker()):
            return
        checkpointed, expired = False, True
    else:
        checkpointed = (ctx.last_checkpoint_ts or 0) >= (ctx.waiting_since or now)
        expired = now - (ctx.waiting_since or now) >= policy.actions.max_wait_s
    if not (checkpointed or expired):
        return
    if expired and not checkpointed and waiting_for not in {"resume", "recheck"}:
        # No checkpoint within max_wait_s: decide on the job as if it reported none until
        # its next one (else every report would wait max_wait_s again).
        svc.state.update_job(job.job_id, wait_expired_ts=f"{now:.3f}")
    # Of the nodes flagged while waiting, the one slowest in the newest steps.
    flagged_at = int(rec.get("step", "0") or 0)
    node, ranks = svc._recheck.slowest(job, candidates(rec), since_step=flagged_at)
    if node != rec.get("node"):
        svc.state.save_decision(decision_id, {"node": node, "ranks": ranks})
    event = StragglerEvent(
        job_id=job.job_id,
        node=node,
        gpu=None,
        ranks=ranks,
        step=flagged_at,
        ts=now,
        cusum_ratio=0.0,
        slowdown_pct=float(rec.get("slowdown_pct", "0")),
        cause="compute",
        scope="gpu",
        since_ts=number(rec.get("since_ts")),
        job_loss_pct=number(rec.get("job_loss_pct")),
    )
    past = svc._node_incidents(node, job, now)
    again = decide(
        event,
        job,
        policy,
        replace(ctx, reports_checkpoints=False, node_incidents=past),
        svc._cluster(nodes, now),
        now,
    )
    recovered = (
        svc._recheck.recovered(job, event.node, policy, event.ranks, since_step=flagged_at)
        if again.action == "evict"
        else None
    )
    again, settled = final(again, Facts(recheck=recovered))  # the verdict, as in _handle
    if settled.get("waiting_for") == "recheck":  # still nothing to re-check on: wait on
        svc.state.save_decision(decision_id, {"waiting_for": "recheck"})
        return
    if again.action != "evict":
        log.info(
            "service.decision",
            decision_id=decision_id,
            job_id=job.job_id,
            node=event.node,
            action="none",
            reasons=again.reasons,
        )
        svc.state.save_decision(
            decision_id, {"state": "recorded", "decision": "none", "reasons": again.reasons}
        )
        svc.state.update_job(job.job_id, waiting="", waiting_since="")
        return
    after = (
        "resume"
        if rec.get("waiting_for") == "resume"
        else ("checkpoint" if checkpointed else "max wait")
    )
    mark = marks.reason(
        f"compute {event.node}",
        f"+{event.slowdown_pct:.1f}% evict",
        decision_id,
        svc.executor.deployment or "",
    )
    unconfirmed = svc._annotate(job, mark, policy)  # our mark on the job before we hold it
    outcome = svc._evict(decision_id, job, event.node, {"after": after, **unconfirmed}, now)
    report.decisions.append({"id": decision_id, "action": "evict", "outcome": outcome})
