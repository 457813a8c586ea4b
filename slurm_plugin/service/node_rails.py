"""The service's rails around nodes: node history (incidents, persistence, healing with time),
the circuit breaker (too many straggler nodes at once), the drain of a persistent straggler
within the partition drain limit, and our explanation of drains our prolog caused. Each turn
of a node to persistent or back is recorded (``action = "mark"``) and queued for the site's
node hooks (``service/hooks.py``)."""

from __future__ import annotations

import structlog

from slurm_plugin.detection import StragglerEvent
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.policy.history import Incident, NodeHistory, evaluate, record_incident
from slurm_plugin.policy.rails import ClusterRails
from slurm_plugin.service.executor import Executor
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.store import hooks

log = structlog.get_logger(__name__)
#: A prolog finding explains a "Prolog error" drain when written at most this long before Slurm
#: set the reason (the prolog's own time budget is far shorter), or _CLOCK_SLACK_S after it.
_PROLOG_MATCH_S = 300.0
_CLOCK_SLACK_S = 30.0


class NodeRails:
    """Node history and the rails around draining, for the service."""

    def __init__(self, state: ServiceState, executor: Executor, *, dry_run: bool) -> None:
        self.state = state
        self.executor = executor
        self.dry_run = dry_run
        self._aged_at = 0.0

    def age(self, now: float, rails: ClusterRails, every_s: float = 300.0) -> list[str]:
        """Every ``every_s``: age every node's history to ``now`` (incidents leave the window,
        a node quiet for forgive_after_days is healthy again). Returns the nodes forgiven. A
        refusal (drain) we made stays until an admin forgives the node."""
        if now - self._aged_at < every_s:
            return []
        self._aged_at = now
        params = rails.persistence.params()
        forgiven = []
        for history in self.state.nodes():
            aged = evaluate(history, now, params, distinct_users=rails.persistence.distinct_users)
            if aged.history == history:
                continue
            self.state.save_node_history(aged.history)
            if aged.forgiven:
                forgiven.append(history.node)
                decision_id = marks.new_decision_id()
                self.state.save_decision(
                    decision_id,
                    {
                        "state": "recorded",
                        "action": "forgive",
                        "node": history.node,
                        "was": history.state,
                        "by": "time",
                        "reasons": aged.reasons,
                    },
                )
                if history.state == "persistent":
                    hooks.push_turn(
                        self.state.client,
                        hooks.FORGIVEN,
                        history,
                        decision_id,
                        ts=now,
                        by="time",
                        was=history.state,
                        reasons=aged.reasons,
                    )
        if forgiven:
            log.info("service.nodes_forgiven", nodes=forgiven)
        return forgiven

    def remember(
        self,
        event: StragglerEvent,
        job: JobInfo,
        job_token: str,
        rails: ClusterRails,
        nodes: tuple[NodeInfo, ...],
        now: float,
        *,
        corroborated: bool = False,
        cluster_mode: str = "observe",
        evicted: bool = False,
        costless: bool = False,
    ) -> None:
        """Node history, persistent-straggler drain and the circuit breaker, under the cluster
        rails (the service's settings, never a job's policy: one job must not set what all
        share). Draining also needs the default policy's ``cluster_mode`` to be evict.
        ``evicted``: the job was requeued without the node on ``event`` (an incident however
        short the slowdown; the report itself was counted for the breaker already).
        ``costless``: the job does not wait for the node (node history only: the breaker
        counts the stragglers the service may act on)."""
        before = self.state.node_history(event.node)
        transition = record_incident(
            before,
            Incident(
                job_token,  # the job's id and first submit time: one id, two jobs, two jobs
                now,
                event.slowdown_pct,
                event.cause,
                job.user,
                corroborated,
                since_ts=event.since_ts,
                lasted_s=event.lasted_s,
                evicted=evicted,
            ),
            rails.persistence.params(),
            distinct_users=rails.persistence.distinct_users,
        )
        self.state.save_node_history(transition.history)
        if transition.became_persistent:
            self._persistent(transition.history, before.state, transition.reasons, now)
        if event.cause == "compute" and not (evicted or costless):  # the window is in Redis
            window = rails.safety.breaker_window_s
            distinct = self.state.flag_for_breaker(event.node, now, window)
            if distinct > rails.safety.breaker_max_nodes and self.state.breaker() is None:
                why = (
                    f"{distinct} straggler nodes within {window:.0f} s (max "
                    f"{rails.safety.breaker_max_nodes}); `straggler resume` to act again"
                )
                self.state.open_breaker(why)
                log.error("service.breaker_open", why=why)
        if not (
            transition.became_persistent and rails.drain_persistent and cluster_mode == "evict"
        ):
            return
        if self.dry_run or self.state.paused() or self.state.breaker():
            return
        node = next((n for n in nodes if n.name == event.node), None)
        if node is None or not node.usable:
            return
        members = [n for n in nodes if set(n.partitions) & set(node.partitions)]
        drained = sum(1 for n in members if not n.usable)
        if (drained + 1) / max(1, len(members)) > rails.safety.max_partition_drained_fraction:
            log.warning(
                "service.drain_refused", node=event.node, reason="partition drain limit reached"
            )
            return
        decision_id = marks.new_decision_id()
        reason = marks.reason(
            "persistent",
            "; ".join(transition.reasons),
            decision_id,
            self.executor.deployment or "",
        )
        self.executor.drain(
            decision_id, event.node, reason, {"job_id": job.job_id}, persistent=True
        )

    def _persistent(self, history: NodeHistory, was: str, reasons: list[str], now: float) -> None:
        """The node just became a persistent straggler: recorded, and its hook queued (drained
        or not: the drain is a decision of its own)."""
        decision_id = marks.new_decision_id()
        self.state.save_decision(
            decision_id,
            {
                "state": "recorded",
                "action": "mark",
                "node": history.node,
                "was": was,
                "now": "persistent",
                "by": "service",
                "reasons": reasons,
            },
        )
        # A dry run queues it too: the service records it as skipped (service/hooks.py).
        hooks.push_turn(
            self.state.client,
            hooks.PERSISTENT,
            history,
            decision_id,
            ts=now,
            by="service",
            was=was,
            reasons=reasons,
        )

    def explain_prolog_drains(self, nodes: tuple[NodeInfo, ...]) -> None:
        """Nodes Slurm drained because our prolog failed get the prolog's finding as reason,
        only when the finding is from the prolog run that caused the drain (written within
        ``_PROLOG_MATCH_S`` before Slurm set the reason); a stale finding is dropped."""
        if self.dry_run:
            return
        for node in nodes:
            if not (node.drained and node.reason.startswith("Prolog error")):
                continue
            found = self.state.prolog_finding(node.name)
            if found is None:
                continue
            finding, written = found
            if (
                node.reason_time is None
                or written is None
                or not (-_PROLOG_MATCH_S <= written - node.reason_time <= _CLOCK_SLACK_S)
            ):
                log.info("service.prolog_finding_unmatched", node=node.name, finding=finding)
                self.state.clear_prolog_finding(node.name)
                continue
            decision_id = marks.new_decision_id()
            reason = marks.reason("prolog", finding, decision_id, self.executor.deployment or "")
            self.executor.drain(decision_id, node.name, reason, {"was": node.reason})
            self.state.clear_prolog_finding(node.name)
            log.warning("service.prolog_drain_explained", node=node.name, reason=reason)
