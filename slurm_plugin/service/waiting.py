"""Before an eviction, is the flagged node still slow? And which of the nodes flagged while a
job waited for its checkpoint is the one to take out? Both from the job's newest steps, so a
burst that is already over never costs a requeue."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from slurm_plugin.detection import Detector, StragglerEvent
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.policy.schema import Policy
from slurm_plugin.policy.verdict import RECOVERED_BELOW, recheck

log = structlog.get_logger(__name__)

Candidate = tuple[str, list[int]]


class Recheck:
    """The re-check from each job's detector: the rows it holds of the job's current attempt
    (detection/recheck.py), so it costs no Redis read and stays cheap at any world size."""

    def __init__(self, detector_of: Callable[[str], Detector | None]) -> None:
        self.detector_of = detector_of

    def slowdown_pct(
        self, job: JobInfo, node: str, ranks: Sequence[int] = (), since_step: int | None = None
    ) -> float | None:
        """``node``'s recent slowdown in the job, or None when it is unknown."""
        detector = self.detector_of(job.job_id)
        if detector is None:
            return None
        return detector.recent_slowdown_pct(job.job_id, node, ranks, since_step)

    def recovered(
        self,
        job: JobInfo,
        node: str,
        policy: Policy,
        ranks: Sequence[int] = (),
        since_step: int | None = None,
    ) -> str | None:
        """Why ``node`` is not to be evicted now (:func:`~slurm_plugin.policy.verdict.recheck`
        of its straggling ``ranks`` since ``since_step``, where it was flagged); None when it
        is still slow."""
        slowdown = self.slowdown_pct(job, node, ranks, since_step)
        log.info(
            "service.recheck",
            job_id=job.job_id,
            node=node,
            slowdown_pct=None if slowdown is None else round(slowdown, 1),
            recovered_below_pct=policy.detection.min_slowdown_pct * RECOVERED_BELOW,
        )
        return recheck(node, slowdown, policy.detection.min_slowdown_pct)

    def slowest(
        self, job: JobInfo, candidates: Sequence[Candidate], since_step: int | None = None
    ) -> Candidate:
        """Of the flagged nodes (never empty), the one slowest in the newest steps from
        ``since_step`` on (the first when none shows any)."""
        return max(
            candidates,
            key=lambda c: self.slowdown_pct(job, c[0], c[1], since_step) or float("-inf"),
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
