"""The decision record, ``stg:decision:{id}`` (and each of its changes in the audit stream
``stg:decisions``): one hash per decision, written by the service and the admin CLI, owned
here. :class:`DecisionRecord` names every field with its type; a write with a field it does
not name is refused (:func:`encode`), a read (:func:`read`) gives typed values and still
reads records of earlier releases (unknown fields kept out, unreadable values as missing).

Fields, in ``docs/redis-schema.md``:

- what and where: ``job_id``, ``node``, ``nodes`` (every node an eviction excludes or advice
  names), ``action`` (``evict``, ``wait``, ``advise`` (the job advised to leave ``nodes``),
  ``annotate``, ``none``, ``drain``, ``release``, ``report``, ``mark``
  and ``forgive`` of a node, ``hook`` (a node hook's run), an admin's ``pause``...), ``state``
  (the state machine of service/executor.py), ``kind`` (a report's, a hook run's);
- the detection: ``cause``, ``scope``, ``slowdown_pct``, ``cusum_ratio``, ``ranks``, ``step``,
  ``since_ts``, ``detected_ts``, ``job_loss_pct``, ``event`` (the event, to be decided on
  again), ``candidates`` (nodes flagged while it waited), ``details`` (a report's event);
- the verdict: ``decision``, ``reasons``, ``saved_s``, ``cost_s``, ``lasted_s``,
  ``expected_s``, ``lasting_p``, ``goodput_inputs``, ``node_incidents``, ``policy``,
  ``waiting_for``, ``rechecking_since``, ``after``, ``advice_deadline_ts`` (until when the job
  may leave the nodes itself), ``hardware_evidence``, ``job_reported_gpu``;
- the job it acted on: ``job_user``, ``job_submit_ts``, ``job_first_submit_ts``,
  ``job_restarts``, ``job_sluid`` (its run's SLUID, 25.11 on), ``restarts_before``;
- the action: ``planned_at``, ``held_at``, ``held_ts``, ``released_at``, ``excluded``,
  ``verified``, ``recovered``, ``landed_late``, ``of``, ``annotated``, ``mark_refused``,
  ``reason``, ``note``, ``error``, ``updated_at``;
- an admin's: ``by``, ``was``, ``now``, ``seconds``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from slurm_plugin.detection.events import StragglerEvent
from slurm_plugin.errors import StragglerError
from slurm_plugin.policy.decide import Decision

Number = float | None


class DecisionRecord(BaseModel):
    """One decision's fields, typed (None: not set)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str = ""
    # what and where
    job_id: str | None = None
    node: str | None = None
    nodes: list[str] | None = None
    action: str | None = None
    state: str | None = None
    kind: str | None = None
    # the detection
    cause: str | None = None
    scope: str | None = None
    slowdown_pct: Number = None
    cusum_ratio: Number = None
    ranks: list[int] | None = None
    step: int | None = None
    since_ts: Number = None
    detected_ts: Number = None
    job_loss_pct: Number = None
    event: dict[str, Any] | None = None
    candidates: list[dict[str, Any]] | None = None
    details: dict[str, Any] | None = None
    # the verdict
    decision: str | None = None
    reasons: list[str] | None = None
    saved_s: Number = None
    cost_s: Number = None
    lasted_s: Number = None
    expected_s: Number = None
    lasting_p: Number = None
    goodput_inputs: dict[str, Any] | None = None
    node_incidents: int | None = None
    policy: str | None = None
    waiting_for: str | None = None
    rechecking_since: Number = None
    after: str | None = None
    advice_deadline_ts: Number = None
    hardware_evidence: list[str] | None = None
    job_reported_gpu: list[str] | None = None
    # the job it acted on
    job_user: str | None = None
    job_submit_ts: Number = None
    job_first_submit_ts: Number = None
    job_restarts: int | None = None
    job_sluid: str | None = None
    restarts_before: int | None = None
    # the action
    planned_at: Number = None
    held_at: Number = None
    held_ts: Number = None
    released_at: Number = None
    excluded: list[str] | None = None
    verified: str | None = None
    recovered: str | None = None
    landed_late: str | None = None
    of: str | None = None
    annotated: str | None = None
    mark_refused: str | None = None
    reason: str | None = None
    note: str | None = None
    error: str | None = None
    updated_at: Number = None
    # an admin's
    by: str | None = None
    was: str | None = None
    now: str | None = None
    seconds: Number = None


#: Every field a record may hold (``id`` is the key's, not a field).
FIELDS = tuple(name for name in DecisionRecord.model_fields if name != "id")
#: The fields that hold JSON (lists and objects).
JSON_FIELDS = frozenset(
    name
    for name, info in DecisionRecord.model_fields.items()
    if "list" in str(info.annotation) or "dict" in str(info.annotation)
)


class RecordFieldError(StragglerError):
    """A write named a field the record does not have, or gave one the wrong kind of value."""


def encode(fields: Mapping[str, Any]) -> dict[str, str]:
    """``fields`` as the hash's text (JSON for lists and objects; None left out); a field
    the record does not name, or a list where text belongs, is refused."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise RecordFieldError(f"not a decision record field: {', '.join(unknown)}")
    flat: dict[str, str] = {}
    for name, value in fields.items():
        if value is None:
            continue
        structured = isinstance(value, list | tuple | dict)
        if structured != (name in JSON_FIELDS):
            raise RecordFieldError(f"decision field {name!r}: {type(value).__name__} given")
        flat[name] = (
            json.dumps(list(value) if isinstance(value, tuple) else value, default=str)
            if structured
            else str(value)
        )
    return flat


def read(raw: Mapping[str, str], decision_id: str | None = None) -> DecisionRecord:
    """A record as Redis holds it (text) with its values typed; a value that does not read
    (an older release's, a NaN, a hand edit) is missing, never an error."""
    values: dict[str, Any] = {}
    for name, text in raw.items():
        if name not in DecisionRecord.model_fields or text in (None, "", "None"):
            continue
        values[name] = _value(name, text)
    if decision_id is not None:
        values["id"] = decision_id
    try:
        return DecisionRecord.model_validate(values)
    except ValidationError as exc:  # drop what does not read, keep the rest
        bad = {str(err["loc"][0]) for err in exc.errors() if err["loc"]}
        return DecisionRecord.model_validate({k: v for k, v in values.items() if k not in bad})


def _value(name: str, text: str) -> Any:
    annotation = str(DecisionRecord.model_fields[name].annotation)
    if name in JSON_FIELDS:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return _json_kept(annotation, value)
    if "float" in annotation:
        return finite(text)
    if "int" in annotation:
        number = finite(text)
        return None if number is None else int(number)
    return text


def _json_kept(annotation: str, value: Any) -> Any:
    """What of a JSON value has the field's type: a list keeps its items of the right kind
    (the integers of ``[1, "x"]``), anything else of the wrong shape is missing."""
    if annotation.startswith("dict"):
        return value if isinstance(value, dict) else None
    if not isinstance(value, list):
        return None
    if "list[int]" in annotation:
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    if "list[str]" in annotation:
        return [v for v in value if isinstance(v, str)]
    return [v for v in value if isinstance(v, dict)]


def finite(text: str) -> float | None:
    """A number a record holds as text, or None when unreadable or not finite (a NaN)."""
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def verdict_fields(
    event: StragglerEvent,
    decision: Decision,
    evidence: list[str],
    reported: list[str],
    node_incidents: int,
) -> dict[str, Any]:
    """What a decision records of the event, the hardware evidence and the verdict with its
    numbers: goodput, how long the slowdown had lasted, how much longer it was expected to
    and how likely to last."""
    return {
        "node": event.node,
        "cause": event.cause,
        "scope": event.scope,
        "slowdown_pct": event.slowdown_pct,
        "cusum_ratio": event.cusum_ratio,
        "ranks": event.ranks[:32],
        "hardware_evidence": evidence,
        "job_reported_gpu": reported,
        "decision": decision.action,
        "reasons": decision.reasons,
        "saved_s": _rounded(decision.saved_s),
        "cost_s": _rounded(decision.cost_s),
        "since_ts": _rounded(event.since_ts),
        "lasted_s": _rounded(decision.lasted_s),
        "expected_s": _rounded(decision.expected_s),
        "lasting_p": _rounded(decision.lasting_p, 3),
        "job_loss_pct": event.job_loss_pct,
        "goodput_inputs": decision.inputs,
        "node_incidents": node_incidents,
    }


def _rounded(value: float | None, digits: int = 1) -> float | None:
    """``value`` rounded for a record (None stays None: the field is left out)."""
    return None if value is None else round(value, digits)
