"""Before an eviction, is the flagged node still slow? And which of the nodes flagged while a
job waited for its checkpoint is the one to take out? Both from the job's newest steps, so a
burst that is already over never costs a requeue."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import structlog

from slurm_plugin.detection import StragglerEvent
from slurm_plugin.detection.recheck import recent_slowdown_pct
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.model.records import StepRecord
from slurm_plugin.policy.schema import Policy
from slurm_plugin.telemetry.store import TelemetryStore

log = structlog.get_logger(__name__)

#: A flagged node counts as recovered when its newest steps show less than this fraction of
#: the policy's minimum slowdown (hysteresis: flagged at the minimum, released below half).
RECOVERED_BELOW = 0.5

Candidate = tuple[str, list[int]]


class Recheck:
    """The re-check on the job's newest steps (its own nodes and current attempt only)."""

    def __init__(self, store: TelemetryStore) -> None:
        self.store = store

    def _records(self, job: JobInfo) -> list[StepRecord]:
        return [
            r
            for r in self.store.latest_steps(job.job_id)
            if r.node in job.nodes and r.attempt == job.restarts
        ]

    def recovered(
        self,
        job: JobInfo,
        node: str,
        policy: Policy,
        ranks: Sequence[int] = (),
        since_step: int | None = None,
    ) -> str | None:
        """Why ``node`` no longer needs evicting (its straggling ``ranks`` are, in the newest
        steps, less than half the policy's minimum slower than the other nodes' ranks, or
        show nothing), or None when it is still slow. Half, not the minimum itself: the
        re-check is a robust median over few steps and the detection a mean over the shift,
        so a node slowed by about the minimum would flip between the two; a burst that is
        over shows ~0 %. Only steps from ``since_step`` (where the node was flagged) count."""
        slowdown = recent_slowdown_pct(self._records(job), node, ranks, since_step=since_step)
        release = policy.detection.min_slowdown_pct * RECOVERED_BELOW
        log.info(
            "service.recheck",
            job_id=job.job_id,
            node=node,
            slowdown_pct=None if slowdown is None else round(slowdown, 1),
            recovered_below_pct=release,
        )
        if slowdown is None:
            return f"recovered, not evicted: no recent steps of {node} to confirm the slowdown"
        if slowdown < release:
            return (
                f"recovered, not evicted: {node} is {slowdown:+.1f}% over its peers in the "
                f"newest steps (recovered below {release:g}%, half the policy's minimum)"
            )
        return None

    def slowest(
        self, job: JobInfo, candidates: Sequence[Candidate], since_step: int | None = None
    ) -> Candidate:
        """Of the flagged nodes (never empty), the one slowest in the newest steps from
        ``since_step`` on (the first when none shows any)."""
        records = self._records(job)
        return max(
            candidates,
            key=lambda c: (
                recent_slowdown_pct(records, c[0], c[1], since_step=since_step) or float("-inf")
            ),
        )


def candidates(rec: dict[str, str]) -> list[Candidate]:
    """A waiting decision's node and the nodes flagged after it, each with its ranks."""
    found = [(rec.get("node", ""), _ints(_json_list(rec.get("ranks"))))]
    for item in _json_list(rec.get("candidates")):
        if isinstance(item, dict) and isinstance(item.get("node"), str):
            found.append((item["node"], _ints(item.get("ranks"))))
    return found


def with_candidate(rec: dict[str, str], event: StragglerEvent) -> list[dict[str, Any]] | None:
    """The waiting decision's new ``candidates`` list with ``event``'s node added, or None when
    that node is one already (two nodes may be flagged in one cycle, one a passing blip)."""
    known = candidates(rec)
    if event.node in {node for node, _ in known}:
        return None
    extra: list[dict[str, Any]] = [{"node": node, "ranks": ranks} for node, ranks in known[1:]]
    extra.append({"node": event.node, "ranks": event.ranks[:32]})
    return extra


def _json_list(text: str | None) -> list[Any]:
    """A JSON list a decision recorded, or [] when missing or unreadable."""
    try:
        value = json.loads(text or "[]")
    except ValueError:
        return []
    return value if isinstance(value, list) else []


def _ints(values: Any) -> list[int]:
    return [v for v in values if isinstance(v, int)] if isinstance(values, list) else []
