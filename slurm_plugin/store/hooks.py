"""The node hooks' queue: ``stg:{hooks}`` (requests waiting) and ``stg:{hooks}:running``
(taken by the leading service, not yet finished), one JSON request per turn of a node's
straggler state. Whoever turns the state pushes the request: the service's rails (a node
becomes persistent, or is forgiven by time), an admin's ``node mark`` and ``node forgive``.
The leading service runs them one at a time (``service/hooks.py``). A request taken and not
finished (the service stopped meanwhile) goes back to the queue when a service starts: each
turn runs at least once, and the decision id tells a hook that sees it twice."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from slurm_plugin.errors import TelemetryError
from slurm_plugin.model import keys
from slurm_plugin.policy.history import Incident, NodeHistory

PERSISTENT, FORGIVEN = "persistent", "forgiven"
KINDS = (PERSISTENT, FORGIVEN)
#: Requests kept waiting at most (the newest): a queue no service drains stays bounded.
QUEUE_MAX = 10_000
#: The version of the JSON a hook reads (``docs/deploy.md``, "Node hooks").
PAYLOAD_VERSION = 1


@dataclass(frozen=True)
class HookRequest:
    """One turn of a node's state, as a hook is told of it."""

    kind: str
    node: str
    decision_id: str
    ts: float
    #: Who turned it: ``service``, ``time`` (forgiven after the quiet period) or the admin.
    by: str
    #: The node's state before.
    was: str
    reasons: list[str] = field(default_factory=list)
    #: The incidents the node's history held (job, when, how slow, cause, hardware-backed).
    incidents: list[dict[str, Any]] = field(default_factory=list)

    def payload(self, deployment: str) -> dict[str, Any]:
        """The JSON object the hook reads on standard input."""
        fields = asdict(self)
        event = fields.pop("kind")
        return {"version": PAYLOAD_VERSION, "event": event, "deployment": deployment, **fields}


def incidents_of(incidents: Sequence[Incident]) -> list[dict[str, Any]]:
    """A history's incidents as a hook reads them."""
    return [
        {
            "job": i.job_id,
            "ts": i.ts,
            "slowdown_pct": round(i.slowdown_pct, 1) if math.isfinite(i.slowdown_pct) else None,
            "cause": i.cause,
            "corroborated": i.corroborated,
        }
        for i in incidents
    ]


def push_turn(
    client: Any,
    kind: str,
    history: NodeHistory,
    decision_id: str,
    *,
    ts: float,
    by: str,
    was: str,
    reasons: Sequence[str],
) -> None:
    """Queue the turn of ``history``'s node recorded as ``decision_id`` (the service's rails
    and the admin's CLI both push through here)."""
    push(
        client,
        HookRequest(
            kind,
            history.node,
            decision_id,
            ts,
            by,
            was,
            list(reasons),
            incidents_of(history.incidents),
        ),
    )


def push(client: Any, request: HookRequest) -> None:
    """Queue ``request`` (the oldest waiting ones beyond :data:`QUEUE_MAX` are dropped)."""
    if request.kind not in KINDS:
        raise ValueError(f"unknown hook kind {request.kind!r}")
    keys.check_node(request.node)
    pipe = client.pipeline(transaction=False)
    pipe.rpush(keys.HOOKS, json.dumps(asdict(request), allow_nan=False))
    pipe.ltrim(keys.HOOKS, -QUEUE_MAX, -1)
    pipe.execute()


def take(client: Any) -> tuple[str, HookRequest | None] | None:
    """The oldest waiting request, moved to the running list (None: none waits); the raw
    entry is what :func:`finish` removes. An entry that does not read gives ``None``."""
    raw = cast("str | bytes | None", client.lmove(keys.HOOKS, keys.HOOKS_RUNNING, "LEFT", "RIGHT"))
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    return text, decode(text)


def finish(client: Any, raw: str) -> None:
    """The request ``raw`` is done (run, failed or skipped): off the running list."""
    client.lrem(keys.HOOKS_RUNNING, 1, raw)


def requeue_running(client: Any) -> int:
    """Requests a stopped service took and never finished go first in the queue again;
    returns how many."""
    moved = 0
    while client.lmove(keys.HOOKS_RUNNING, keys.HOOKS, "RIGHT", "LEFT") is not None:
        moved += 1
    return moved


def waiting(client: Any) -> int:
    """How many requests wait."""
    return int(client.llen(keys.HOOKS))


def queued(client: Any) -> list[HookRequest]:
    """The requests waiting, oldest first (those that do not read left out)."""
    raw = cast("list[str | bytes]", client.lrange(keys.HOOKS, 0, -1))
    found = [decode(r.decode() if isinstance(r, bytes) else r) for r in raw]
    return [r for r in found if r is not None]


def decode(text: str) -> HookRequest | None:
    """A queued request, or None when it does not read (never raises)."""
    try:
        data = json.loads(text)
        request = HookRequest(
            kind=str(data["kind"]),
            node=keys.check_node(str(data["node"])),
            decision_id=str(data["decision_id"]),
            ts=float(data["ts"]),
            by=str(data.get("by", "")),
            was=str(data.get("was", "")),
            reasons=[str(r) for r in data.get("reasons") or []],
            incidents=[dict(i) for i in data.get("incidents") or [] if isinstance(i, dict)],
        )
    except (ValueError, KeyError, TypeError, AttributeError, TelemetryError):
        return None
    return request if request.kind in KINDS and math.isfinite(request.ts) else None
