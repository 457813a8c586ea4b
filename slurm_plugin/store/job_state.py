"""The service's state for one job, ``stg:job:{J}:service``: one hash per job, written only by
the service (its ingest, identity check, policy choice and decisions), read by it and by the
admin CLI, owned here. :class:`JobState` names every field with its type; a write with a
field it does not name is refused (:func:`encode`), a read (:func:`read`) gives typed values
(missing or unreadable: None) and still reads the hashes of earlier releases.

Fields, in ``docs/redis-schema.md``:

- reading the job's streams: ``steps_cursor``, ``events_cursor``, ``steps_read``,
  ``steps_lost``, ``steps_missing``, ``steps_repeats``, and ``ignored_<reason>`` (records not
  believed, by reason: the one family of names, counted with HINCRBY);
- what the job reports: ``structure`` (JSON: its by-design rank offsets), ``reports_checkpoints``
  (``1``), ``last_checkpoint_ts``, ``checkpoint_period_s``;
- its decisions: ``policy``, ``evictions``, ``last_eviction_ts``, ``from_start_requeued``
  (the attempt requeued for a slowdown there since its first steps), ``waiting`` (the id of
  its waiting decision, empty when none), ``waiting_since``, ``wait_expired_ts``;
- whose job it is (service/identity.py): ``identity_user``, ``identity_submit_ts``,
  ``identity_first_submit_ts``, ``identity_restarts``, ``identity_sluid`` (the run's SLUID,
  25.11 on; empty before);
- advice (store/advice.py): ``advised_nodes`` (nodes the job was advised to leave),
  ``advice_acted`` (``decision_id:node`` pairs the job reported leaving).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from slurm_plugin.errors import StragglerError
from slurm_plugin.policy.decide import JobContext
from slurm_plugin.store.decision import finite

#: The counts of records not believed, one field per reason.
IGNORED_PREFIX = "ignored_"


class JobState(BaseModel):
    """One job's service state, typed (None: not set)."""

    model_config = ConfigDict(frozen=True)

    steps_cursor: str | None = None
    events_cursor: str | None = None
    steps_read: int | None = None
    steps_lost: int | None = None
    steps_missing: int | None = None
    steps_repeats: int | None = None
    structure: list[dict[str, Any]] | None = None
    reports_checkpoints: bool = False
    last_checkpoint_ts: float | None = None
    checkpoint_period_s: float | None = None
    policy: str | None = None
    evictions: int = 0
    last_eviction_ts: float | None = None
    #: The attempt the job was requeued from for a slowdown there since its first steps.
    from_start_requeued: int | None = None
    waiting: str | None = None
    waiting_since: float | None = None
    wait_expired_ts: float | None = None
    identity_user: str | None = None
    identity_submit_ts: str | None = None
    identity_first_submit_ts: str | None = None
    identity_restarts: str | None = None
    identity_sluid: str | None = None
    #: Nodes the job was advised to leave (comma-separated; store/advice.py): a node it is
    #: still slow on after that is requeued away, never advised again.
    advised_nodes: str | None = None
    #: What the job reported it acted on: ``decision_id:node`` pairs, comma-separated.
    advice_acted: str | None = None
    #: ``ignored_<reason>`` counts.
    ignored: dict[str, int] = {}

    def advised(self) -> frozenset[str]:
        """The nodes the job was advised to leave."""
        return frozenset(n for n in (self.advised_nodes or "").split(",") if n)

    def acted(self) -> dict[str, frozenset[str]]:
        """Decision id -> the nodes the job reported leaving on its advice."""
        found: dict[str, set[str]] = {}
        for pair in (self.advice_acted or "").split(","):
            decision_id, _, node = pair.partition(":")
            if decision_id and node:
                found.setdefault(decision_id, set()).add(node)
        return {d: frozenset(nodes) for d, nodes in found.items()}

    def context(self) -> JobContext:
        """What the goodput rule knows of the job. A checkpoint that did not come within the
        policy's ``max_wait_s`` (``wait_expired_ts``) makes the job one that reports none,
        until its next checkpoint."""
        expired = self.wait_expired_ts is not None and (
            (self.last_checkpoint_ts or 0.0) <= self.wait_expired_ts
        )
        return JobContext(
            evictions=self.evictions,
            last_eviction_ts=self.last_eviction_ts,
            last_checkpoint_ts=self.last_checkpoint_ts,
            reports_checkpoints=self.reports_checkpoints and not expired,
            checkpoint_period_s=self.checkpoint_period_s,
            waiting_since=self.waiting_since,
            from_start_requeued=self.from_start_requeued,
        )


FIELDS = tuple(name for name in JobState.model_fields if name != "ignored")


class JobFieldError(StragglerError):
    """A write named a field the job's service state does not have."""


def encode(fields: Mapping[str, Any]) -> dict[str, str]:
    """``fields`` as the hash's text; a field the state does not name is refused."""
    unknown = sorted(
        name for name in fields if name not in FIELDS and not name.startswith(IGNORED_PREFIX)
    )
    if unknown:
        raise JobFieldError(f"not a job service state field: {', '.join(unknown)}")
    return {name: _text(value) for name, value in fields.items()}


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list | dict):
        return json.dumps(value, default=str)
    return str(value)


def _kind(name: str, annotation: object) -> str:
    """How a field's text reads: by its type (``structure`` is JSON)."""
    text = str(annotation)
    if name == "structure":
        return "structure"
    return next((k for k in ("bool", "int", "float") if k in text), "str")


#: Per field of the hash, how its text reads (read once a cycle per job: the annotation's
#: text is not worked out again each time).
_KINDS = {
    name: _kind(name, info.annotation)
    for name, info in JobState.model_fields.items()
    if name != "ignored"
}


def read(raw: Mapping[str, str]) -> JobState:
    """The hash as Redis holds it (text) with its values typed; a value that does not read
    is missing, never an error."""
    values: dict[str, Any] = {}
    ignored: dict[str, int] = {}
    for name, text in raw.items():
        if name.startswith(IGNORED_PREFIX):
            count = _int(text)
            if count is not None:
                ignored[name.removeprefix(IGNORED_PREFIX)] = count
            continue
        kind = _KINDS.get(name)
        if kind is None or text in (None, "", "None"):
            continue
        if kind == "structure":
            values[name] = _structure(text)
        elif kind == "bool":
            values[name] = text == "1"
        elif kind == "int":
            number = _int(text)
            if number is not None:
                values[name] = number
        elif kind == "float":
            value = finite(text)
            if value is not None:
                values[name] = value
        else:
            values[name] = text
    return JobState.model_validate({**values, "ignored": ignored})


def _structure(text: str) -> list[dict[str, Any]] | None:
    """The job's learned structure (JSON, written by the service only)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return [g for g in value if isinstance(g, dict)] if isinstance(value, list) else None


def _int(text: str) -> int | None:
    value = finite(text)
    return None if value is None else int(value)
