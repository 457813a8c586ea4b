"""Drain and resume, read back from Slurm: the audit says what Slurm shows, never what we
asked for.

A drain is ``planned`` (persisted before the call) and becomes ``verified`` only once Slurm
shows the node draining with our reason and this decision's id. When the call fails without
an answer (a timeout, slurmctld away) the outcome is unknown: the decision stays open and is
checked again every cycle, becoming ``verified`` if the drain landed after all, or
``abandoned`` once ``unknown_grace_s`` have passed without it. A call Slurm refused, or that
it answered without the node changing, is ``failed``. A resume is the same, read back as the
node no longer draining (24.11 keeps the old Reason for 20 s or more: the state flags count).

A persistent straggler's drain also asks the prolog to refuse the node, and asks it before
the call: a drain that lands but times out, or one the service never sent (it stopped between
the plan and the call), still keeps the node out of jobs if an admin resumes it, until the
node is forgiven. Such a drain that never landed is not abandoned on recovery while the
refusal stands: it is sent again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import structlog

from slurm_plugin.errors import CommandTimeoutError, SlurmError
from slurm_plugin.model.cluster import NodeInfo
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.slurm.scheduler import Scheduler
from slurm_plugin.store.decision import DecisionRecord

log = structlog.get_logger(__name__)

#: The ``kind`` of a persistent straggler's drain decision.
PERSISTENT = "persistent"


class NodeActions:
    """Drains and resumes nodes for the service, each read back from Slurm."""

    def __init__(
        self,
        scheduler: Scheduler,
        state: ServiceState,
        *,
        clock: Callable[[], float] = time.time,
        unknown_grace_s: float = 60.0,
        deployment: str | None = None,
    ) -> None:
        self.slurm = scheduler
        self.state = state
        self.clock = clock
        self.unknown_grace_s = unknown_grace_s
        self.deployment = deployment

    def drain(
        self,
        decision_id: str,
        node: str,
        reason: str,
        record: Mapping[str, object] | None = None,
        *,
        persistent: bool = False,
    ) -> str:
        """Drain ``node`` with our reason (persisted first; for a ``persistent`` straggler
        the prolog's refusal too); the decision's state."""
        self.state.save_decision(
            decision_id,
            {
                **(record or {}),
                "state": "planned",
                "action": "drain",
                "node": node,
                "reason": reason,
                "planned_at": f"{self.clock():.3f}",
                **({"kind": PERSISTENT} if persistent else {}),
            },
        )
        if persistent:
            self.state.refuse(node, decision_id, reason)
        return self._act(decision_id, "drain", node, lambda: self.slurm.drain(node, reason))

    def resume(self, node: str, reason: str, decision_id: str) -> bool:
        """Resume ``node`` only when its drain reason is ours (this deployment's); True when
        Slurm shows it resumed (an unknown outcome is re-checked by :meth:`recover`)."""
        if not marks.is_ours(reason, self.deployment):
            return False
        self.state.save_decision(
            decision_id,
            {
                "state": "planned",
                "action": "resume",
                "node": node,
                "was": reason,
                "planned_at": f"{self.clock():.3f}",
            },
        )
        return self._act(decision_id, "resume", node, lambda: self.slurm.resume(node)) == (
            "verified"
        )

    def recover(self, rec: DecisionRecord) -> str:
        """Finish an open drain or resume from what Slurm shows now; a persistent straggler's
        drain that never landed is sent again while its refusal stands."""
        planned_at = rec.planned_at if rec.planned_at is not None else self.clock()
        node, reason = rec.node or "", rec.reason or ""
        again = rec.action == "drain" and rec.kind == PERSISTENT and self._refused_by(node, rec.id)
        outcome = self._check(rec.id, rec.action or "", node, planned_at, give_up=not again)
        if outcome != "overdue":
            return outcome
        log.warning("executor.drain_sent_again", decision_id=rec.id, node=node)
        self.state.save_decision(
            rec.id,
            {
                "planned_at": f"{self.clock():.3f}",
                "note": "the drain never landed (stopped before the call, or no answer): sent "
                "again, the node's refusal standing",
            },
        )
        return self._act(rec.id, "drain", node, lambda: self.slurm.drain(node, reason))

    def _refused_by(self, node: str, decision_id: str) -> bool:
        """True while ``node``'s prolog refusal is this decision's (not forgiven since)."""
        refusal = self.state.refusal(node)
        return refusal is not None and refusal.get("decision_id") == decision_id

    def _act(self, decision_id: str, action: str, node: str, call: Callable[[], None]) -> str:
        planned_at = self.clock()
        self.state.replicated()  # the plan outlives a failover before Slurm is touched
        try:
            call()
        except SlurmError as exc:
            if not _unanswered(exc):
                self.state.save_decision(decision_id, {"state": "failed", "error": str(exc)})
                return "failed"
            self.state.save_decision(
                decision_id, {"error": f"{action}: {exc} (outcome unknown; re-checked)"}
            )
            return "pending"
        return self._check(decision_id, action, node, planned_at, answered=True)

    def _check(
        self,
        decision_id: str,
        action: str,
        node: str,
        planned_at: float,
        answered: bool = False,
        *,
        give_up: bool = True,
    ) -> str:
        """The action's outcome as Slurm shows it: verified, failed, pending (may still land),
        abandoned (never landed, unanswered) or, without ``give_up``, overdue (the same,
        left for the caller to finish)."""
        try:
            info = next((n for n in self.slurm.nodes() if n.name == node), None)
        except SlurmError as exc:  # Slurm away: the next cycle reads it back
            self.state.save_decision(decision_id, {"error": f"read back: {exc} (re-checked)"})
            return "pending"
        if info is None:
            self.state.save_decision(
                decision_id, {"state": "failed", "error": f"Slurm knows no node {node}"}
            )
            return "failed"
        if self._done(action, info, decision_id):
            self.state.save_decision(decision_id, {"state": "verified", "verified": _shown(info)})
            return "verified"
        if not answered and self.clock() - planned_at < self.unknown_grace_s:
            return "pending"  # a call that timed out may still land
        if not answered and not give_up:
            return "overdue"
        final = "failed" if answered else "abandoned"
        self.state.save_decision(
            decision_id,
            {"state": final, "error": f"{action} did not take: Slurm shows {_shown(info)}"},
        )
        log.warning("executor.node_action_not_done", decision_id=decision_id, node=node)
        return final

    def _done(self, action: str, info: NodeInfo, decision_id: str) -> bool:
        if action == "drain":
            return info.drained and marks.decision_of(info.reason, self.deployment) == decision_id
        return not info.drained


def _unanswered(exc: SlurmError) -> bool:
    """Slurm did not say (a timeout, no controller): the call may have taken effect."""
    text = str(exc).lower()
    return isinstance(exc.__cause__, CommandTimeoutError) or "unable to contact" in text


def _shown(info: NodeInfo) -> str:
    return f"state={info.state} flags={','.join(info.flags)} reason={info.reason!r}"
