"""The node record, ``stg:node:{N}``: one hash per node, with five writers (the service, the
prolog, the epilog, the root node sidecar, an admin through the CLI) and this module as its
only owner. Every field name is a constant here; every write and read goes through
:class:`NodeRecord`, so renaming a field is one change that every writer and reader sees.

Fields (``docs/redis-schema.md``): ``history`` (JSON node history) with ``state`` and
``history_ts`` for quick listing; ``refusal`` (JSON: decision id, reason, time; the only field
that makes the prolog refuse the node); ``last_check`` (the prolog's last result, JSON) with
``prolog_finding``/``prolog_finding_ts`` while the last prolog failed; ``last_epilog`` (JSON);
``sidecar`` (the root sidecar's latest sample, JSON text).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

from slurm_plugin.model import keys
from slurm_plugin.model.records import to_text
from slurm_plugin.policy.history import Incident, NodeHistory

HISTORY = "history"
STATE = "state"
HISTORY_TS = "history_ts"
REFUSAL = "refusal"
LAST_CHECK = "last_check"
PROLOG_FINDING = "prolog_finding"
PROLOG_FINDING_TS = "prolog_finding_ts"
LAST_EPILOG = "last_epilog"
SIDECAR = "sidecar"
#: Every field, for the schema document's test and for readers that list them.
FIELDS = (
    HISTORY,
    STATE,
    HISTORY_TS,
    REFUSAL,
    LAST_CHECK,
    PROLOG_FINDING,
    PROLOG_FINDING_TS,
    LAST_EPILOG,
    SIDECAR,
)


def _text(value: Any) -> str | None:
    """A hash value as text, whether the client decodes replies or not."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False, default=str)


class NodeRecord:
    """Reads and writes one node's hash (``client`` may decode replies or not)."""

    def __init__(self, client: Any, node: str) -> None:
        self.client = client
        self.node = node
        self.key = keys.node(node)

    def fields(self) -> dict[str, str]:
        """The whole hash as text (empty when the node is unknown)."""
        return to_text(self.client.hgetall(self.key))

    # -- the service's history -------------------------------------------------------------
    def history(self) -> NodeHistory:
        """The node's history (empty when unknown or unreadable)."""
        return parse_history(self.node, _text(self.client.hget(self.key, HISTORY)))

    def save_history(self, history: NodeHistory, now: float) -> None:
        """Persist the history, its state for quick listing and when it was saved."""
        self.client.hset(
            self.key,
            mapping={
                HISTORY: json.dumps(_stored(history)),
                STATE: history.state,
                HISTORY_TS: f"{now:.0f}",
            },
        )

    # -- the refusal (the service after its rails, or an admin) ----------------------------
    def refuse(self, decision_id: str, reason: str, now: float) -> None:
        """Make every prolog on the node fail until :meth:`withdraw_refusal`."""
        self.client.hset(
            self.key, REFUSAL, _json({"decision_id": decision_id, "reason": reason, "at": now})
        )

    def refusal(self) -> dict[str, Any] | None:
        """The standing refusal, if any (an unreadable one still refuses)."""
        raw = _text(self.client.hget(self.key, REFUSAL))
        if not raw:
            return None
        try:
            found = json.loads(raw)
        except ValueError:
            found = None
        if not isinstance(found, dict):
            return {"reason": "unreadable refusal", "decision_id": ""}
        return found

    def withdraw_refusal(self) -> None:
        """Let prologs on the node pass again."""
        self.client.hdel(self.key, REFUSAL)

    # -- the prolog and the epilog ---------------------------------------------------------
    def record_check(self, check: Mapping[str, Any], finding: str | None, now: float) -> None:
        """The prolog's result: ``last_check`` always; the finding and its time while it
        fails, cleared when it passes (an old finding must not explain a new drain)."""
        mapping = {LAST_CHECK: _json(check)}
        if finding:
            mapping[PROLOG_FINDING] = finding
            mapping[PROLOG_FINDING_TS] = f"{now:.3f}"
        self.client.hset(self.key, mapping=mapping)
        if not finding:
            self.clear_prolog_finding()

    def last_check(self) -> dict[str, Any]:
        """The prolog's last result (empty when none or unreadable)."""
        return parse_object(_text(self.client.hget(self.key, LAST_CHECK)))

    def prolog_finding(self) -> tuple[str, float | None] | None:
        """What the prolog found when it last failed on the node and when, or None."""
        finding, ts = (
            _text(v) for v in self.client.hmget(self.key, [PROLOG_FINDING, PROLOG_FINDING_TS])
        )
        if not finding:
            return None
        try:
            return finding, float(ts) if ts else None
        except ValueError:
            return finding, None

    def clear_prolog_finding(self) -> None:
        """The finding was used, is stale, or the prolog passed: forget it."""
        self.client.hdel(self.key, PROLOG_FINDING, PROLOG_FINDING_TS)

    def record_epilog(self, result: Mapping[str, Any]) -> None:
        """The epilog's result."""
        self.client.hset(self.key, LAST_EPILOG, _json(result))

    # -- the root node sidecar -------------------------------------------------------------
    def record_sample(self, text: str) -> None:
        """The root sidecar's latest sample, as the JSON text it publishes."""
        self.client.hset(self.key, SIDECAR, text)


def histories(client: Any, nodes: Sequence[str]) -> list[NodeHistory]:
    """The histories of ``nodes`` in one round trip (empty for unknown or unreadable ones)."""
    pipe = client.pipeline(transaction=False)
    for node in nodes:
        pipe.hget(keys.node(node), HISTORY)
    return [parse_history(n, _text(raw)) for n, raw in zip(nodes, pipe.execute(), strict=True)]


#: Incident fields that matter only while an incident is added (``is_incident``), and that
#: the release before them would not read: never stored, so a rollback keeps every history.
_NOT_STORED = ("evicted",)


def _stored(history: NodeHistory) -> dict[str, Any]:
    data = asdict(history)
    for incident in data["incidents"]:
        for name in _NOT_STORED:
            incident.pop(name, None)
    return data


def parse_history(node: str, raw: str | None) -> NodeHistory:
    """A ``history`` field's value as a node history (empty when missing or unreadable)."""
    if not raw:
        return NodeHistory(node)
    try:
        data = json.loads(raw)
        # Fields this release does not know (a later one's) are left out, never the history.
        known = {f.name for f in fields(Incident)}
        incidents = tuple(
            Incident(**{k: v for k, v in i.items() if k in known})
            for i in data.pop("incidents", [])
        )
        return NodeHistory(
            node=node, incidents=incidents, **{k: v for k, v in data.items() if k != "node"}
        )
    except (ValueError, TypeError, AttributeError):
        return NodeHistory(node)


def parse_object(raw: str | None) -> dict[str, Any]:
    """A JSON-object field's value (``last_check``, ``sidecar``...); empty when missing, not
    JSON or not an object."""
    if not raw:
        return {}
    try:
        found = json.loads(raw)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


__all__ = ["FIELDS", "NodeRecord", "parse_history", "parse_object"]
