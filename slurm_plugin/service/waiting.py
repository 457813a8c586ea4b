"""The service's side of the decision lifecycle's state: a job's waiting decision read from,
and its candidates written to, its decision record; and the re-check from the job's detector.

The re-check reads the rows the job's detector holds of its current attempt
(detection/recheck.py), so it costs no Redis read and stays cheap at any world size.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, get_args

import structlog

from slurm_plugin.detection import Detector, StragglerEvent
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.policy.lifecycle import Candidate, Recheck, Waiting, WaitingFor
from slurm_plugin.policy.verdict import RECOVERED_BELOW
from slurm_plugin.service.record import number

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


def waiting_of(decision_id: str, rec: Mapping[str, str], since: float | None) -> Waiting | None:
    """The lifecycle's waiting state from a waiting decision's record (None when it is not
    one); records of 0.1 (no ``event``, candidates as node and ranks) still read."""
    if rec.get("state") != "waiting" or not rec.get("node"):
        return None
    saved = _json(rec.get("event"), {})
    first = _event(rec, saved, rec.get("node", ""), _ints(rec.get("ranks")))
    found = [Candidate(first, int(number(rec.get("node_incidents")) or 0))]
    for item in _json(rec.get("candidates"), []):
        if isinstance(item, dict) and isinstance(item.get("node"), str):
            event = _event(rec, saved, item["node"], item)
            found.append(Candidate(event, int(item.get("node_incidents") or 0)))
    raw = rec.get("waiting_for") or "checkpoint"
    waiting_for: WaitingFor = raw if raw in _WAITING_FOR else "checkpoint"  # type: ignore[assignment]
    start = since if since is not None else number(rec.get("detected_ts")) or 0.0
    return Waiting(decision_id, tuple(found), start, waiting_for)


def candidates_field(waiting: Waiting) -> list[dict[str, Any]]:
    """The record's ``candidates``: each node flagged after the first, with its own event."""
    return [
        {
            "node": c.event.node,
            "ranks": c.event.ranks[:32],
            "node_incidents": c.node_incidents,
            **{
                k: v
                for k, v in c.event.to_dict().items()
                if k in {"slowdown_pct", "since_ts", "job_loss_pct", "cause", "scope", "gpu"}
            },
        }
        for c in waiting.candidates[1:]
    ]


def _event(
    rec: Mapping[str, str], saved: Mapping[str, Any], node: str, item: Any
) -> StragglerEvent:
    """An event a record kept: its own ``saved`` fields, else the record's flat ones."""
    ranks = _ints(item.get("ranks")) if isinstance(item, dict) else _ints(item)

    def pick(key: str, default: Any = None) -> Any:
        if isinstance(item, dict) and key in item:
            return item[key]
        return saved.get(key, rec.get(key, default))

    cause = str(pick("cause", "compute"))
    scope = str(pick("scope", "gpu"))
    return StragglerEvent(
        job_id=str(saved.get("job_id", rec.get("job_id", ""))),
        node=node,
        gpu=pick("gpu") if isinstance(pick("gpu"), int) else None,
        ranks=ranks,
        step=int(number(str(saved.get("step", rec.get("step", "0")))) or 0),
        ts=number(str(saved.get("ts", rec.get("detected_ts")))) or 0.0,
        cusum_ratio=number(str(pick("cusum_ratio", "0"))) or 0.0,
        slowdown_pct=number(str(pick("slowdown_pct", "0"))) or 0.0,
        cause=cause if cause in {"compute", "input"} else "compute",  # type: ignore[arg-type]
        scope=scope if scope in {"gpu", "node"} else "gpu",  # type: ignore[arg-type]
        since_ts=number(str(pick("since_ts"))),
        job_loss_pct=number(str(pick("job_loss_pct"))),
    )


def _json(text: str | None, default: Any) -> Any:
    """A JSON value a decision recorded, or ``default`` when missing or unreadable."""
    try:
        value = json.loads(text or "null")
    except ValueError:
        return default
    return value if isinstance(value, type(default)) else default


def _ints(values: Any) -> list[int]:
    if isinstance(values, str):
        values = _json(values, [])
    return [v for v in values if isinstance(v, int)] if isinstance(values, list) else []
