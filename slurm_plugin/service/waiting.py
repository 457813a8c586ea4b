"""The service's side of the decision lifecycle's state: a job's waiting decision read from,
and its candidates written to, its decision record; and the re-check from the job's detector.

The re-check reads the rows the job's detector holds of its current attempt
(detection/recheck.py), so it costs no Redis read and stays cheap at any world size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, get_args

import structlog

from slurm_plugin.detection import Detector, StragglerEvent
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.policy.lifecycle import Candidate, Recheck, Waiting, WaitingFor
from slurm_plugin.policy.verdict import RECOVERED_BELOW
from slurm_plugin.store.decision import DecisionRecord

log = structlog.get_logger(__name__)

_WAITING_FOR = set(get_args(WaitingFor))


def probe(
    detector_of: Callable[[str], Detector | None], job: JobInfo, min_slowdown_pct: float
) -> Recheck:
    """The lifecycle's re-check of ``job``, from its detector's newest rows (None: unknown)."""

    def recheck(event: StragglerEvent, since_step: int) -> float | None:
        detector = detector_of(job.job_id)
        slowdown = (
            None
            if detector is None
            else detector.recent_slowdown_pct(job.job_id, event.node, event.ranks, since_step)
        )
        log.info(
            "service.recheck",
            job_id=job.job_id,
            node=event.node,
            slowdown_pct=None if slowdown is None else round(slowdown, 1),
            recovered_below_pct=min_slowdown_pct * RECOVERED_BELOW,
        )
        return slowdown

    return recheck


def event_fields(event: StragglerEvent) -> dict[str, Any]:
    """What a decision record keeps of the event it was taken on, to be decided on again."""
    return {"event": {k: v for k, v in event.to_dict().items() if k != "ranks"}}


def waiting_of(rec: DecisionRecord, since: float | None) -> Waiting | None:
    """The lifecycle's waiting state from a waiting decision's record (None when it is not
    one); records of 0.1 (no ``event``, candidates as node and ranks) still read."""
    if rec.state != "waiting" or not rec.node:
        return None
    saved = rec.event or {}
    first = _event(rec, saved, {"node": rec.node, "ranks": rec.ranks or []})
    found = [Candidate(first, rec.node_incidents or 0)]
    for item in rec.candidates or []:
        if isinstance(item.get("node"), str):
            found.append(Candidate(_event(rec, saved, item), _int(item.get("node_incidents"))))
    raw = rec.waiting_for or "checkpoint"
    waiting_for: WaitingFor = raw if raw in _WAITING_FOR else "checkpoint"  # type: ignore[assignment]
    start = since if since is not None else rec.detected_ts or 0.0
    rechecking = rec.rechecking_since if waiting_for == "recheck" else None
    advised = tuple(rec.nodes or (rec.node,)) if waiting_for == "advice" else ()
    return Waiting(rec.id, tuple(found), start, waiting_for, rechecking, advised)


#: What a candidate keeps of its own event (beside node, ranks and its incidents).
_CANDIDATE_FIELDS = frozenset(
    {
        "slowdown_pct",
        "since_ts",
        "job_loss_pct",
        "cause",
        "scope",
        "gpu",
        "level_z",
        "level_z_min",
        "from_start",
        "maybe_a_stage",
    }
)


def candidates_field(waiting: Waiting) -> list[dict[str, Any]]:
    """The record's ``candidates``: each node flagged after the first, with its own event."""
    return [
        {
            "node": c.event.node,
            "ranks": c.event.ranks[:32],
            "node_incidents": c.node_incidents,
            **{k: v for k, v in c.event.to_dict().items() if k in _CANDIDATE_FIELDS},
        }
        for c in waiting.candidates[1:]
    ]


def _event(
    rec: DecisionRecord, saved: Mapping[str, Any], item: Mapping[str, Any]
) -> StragglerEvent:
    """An event a record kept: the candidate's own fields (``item``), else the saved event's,
    else the record's."""

    def pick(key: str) -> Any:
        if key in item:
            return item[key]
        return saved.get(key, getattr(rec, key, None))

    cause, scope, gpu = pick("cause"), pick("scope"), pick("gpu")
    return StragglerEvent(
        job_id=str(saved.get("job_id", rec.job_id or "")),
        node=str(item["node"]),
        gpu=gpu if isinstance(gpu, int) and not isinstance(gpu, bool) else None,
        ranks=[r for r in item.get("ranks") or [] if isinstance(r, int)],
        step=int(_number(saved.get("step", rec.step)) or 0),
        ts=_number(saved.get("ts", rec.detected_ts)) or 0.0,
        cusum_ratio=_number(pick("cusum_ratio")) or 0.0,
        slowdown_pct=_number(pick("slowdown_pct")) or 0.0,
        cause=cause if cause in {"compute", "input"} else "compute",
        scope=scope if scope in {"gpu", "node"} else "gpu",
        since_ts=_number(pick("since_ts")),
        job_loss_pct=_number(pick("job_loss_pct")),
        level_z=_number(pick("level_z")),
        level_z_min=_number(pick("level_z_min")),
        from_start=pick("from_start") is True,
        maybe_a_stage=pick("maybe_a_stage") is True,
    )


def _number(value: Any) -> float | None:
    """A number a record kept (JSON or text), or None when missing, unreadable or not finite."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _int(value: Any) -> int:
    return int(_number(value) or 0)
