"""The service's advice to a job, ``stg:job:{J}:advice``: which nodes to leave, why, under
which decision and until when. Written only by the service (a decision under
``recovery = "advice"``), read by the job with its own credential (``straggler advice JOB``,
a launcher that acts on it: ``straggler leave-on-advice``) and by admins; owned here.

One JSON string per job (the newest advice; a job has at most one waiting decision), with a
TTL a little past its deadline: advice that no longer holds is gone. The job answers through
its own events stream: an ``advice_acted`` event (``decision_id``, ``node``) per node it left
(:func:`acted_event`), which the service counts only for the decision it names and only for
a node that decision advised.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slurm_plugin.errors import TelemetryError
from slurm_plugin.model import keys

#: The record's layout version (readers refuse one they do not know).
VERSION = 1
#: The event a job reports when one of its nodes left on advice.
ACTED = "advice_acted"
#: How long advice outlives its deadline in Redis (a launcher that polls late still reads
#: why it was requeued).
KEEP_AFTER_DEADLINE_S = 600
#: A decision id as the service makes them (slurm/marks.py), the only kind an event may name.
_DECISION_ID = re.compile(r"^[0-9a-z][0-9a-z-]{5,63}$")


class Advice(BaseModel):
    """Advice to one job: leave ``leave`` by ``deadline_ts`` (epoch s), or be requeued
    without them."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    version: int = VERSION
    job_id: str
    decision_id: str
    leave: list[str] = Field(min_length=1)
    reasons: list[str] = []
    slowdown_pct: float | None = None
    issued_ts: float
    deadline_ts: float

    def holds(self, now: float) -> bool:
        """The job may still act on it."""
        return now < self.deadline_ts

    def for_node(self, node: str) -> bool:
        """This advice asks ``node`` to leave."""
        return node in self.leave


def publish(client: Any, advice: Advice) -> None:
    """Write (replace) the job's advice, expiring a little past its deadline."""
    ttl = max(1, math.ceil(advice.deadline_ts - advice.issued_ts) + KEEP_AFTER_DEADLINE_S)
    client.set(keys.job_advice(advice.job_id), advice.model_dump_json(), ex=ttl)


#: Delete the advice only while it is the one of ``ARGV[1]``, in one step: advice of another
#: decision written between a read and a delete stays. A record that is not JSON stays too
#: (a reader names it).
_WITHDRAW = """
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local ok, record = pcall(cjson.decode, v)
if not ok or type(record) ~= 'table' or record['decision_id'] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


def withdraw(client: Any, job_id: str, decision_id: str) -> bool:
    """Delete the job's advice if it is still the one of ``decision_id`` (a newer advice of
    another decision stays), atomically; True when deleted."""
    return bool(client.eval(_WITHDRAW, 1, keys.job_advice(job_id), decision_id))


def read(client: Any, job_id: str) -> Advice | None:
    """The job's advice; None when there is none. A record this release cannot read raises
    :class:`TelemetryError`; Redis away, redis-py's error (the CLI names the server)."""
    raw = client.get(keys.job_advice(job_id))
    if raw is None:
        return None
    return decode(raw)


def decode(raw: str | bytes) -> Advice:
    """An advice record from its JSON."""
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise TelemetryError(f"advice record of unknown version: {str(raw)[:80]!r}")
        return Advice.model_validate(data)
    except (ValueError, ValidationError) as exc:
        raise TelemetryError(f"unreadable advice record: {exc}".splitlines()[0]) from exc


def acted_event(decision_id: str, node: str) -> dict[str, str]:
    """The fields of the event a job reports when ``node`` left on advice ``decision_id``."""
    return {"decision_id": decision_id, "node": node}


def acted_of(events: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The (decision id, node) pairs of the ``advice_acted`` events among ``events`` that are
    well formed; anything else a job wrote is ignored (it is the job's text, and it can only
    spare the job itself a requeue)."""
    found = []
    for event in events:
        if event.get("name") != ACTED:
            continue
        decision_id, node = event.get("decision_id"), event.get("node")
        if not isinstance(decision_id, str) or not _DECISION_ID.match(decision_id):
            continue
        if not isinstance(node, str):
            continue
        try:
            found.append((decision_id, keys.check_node(node)))
        except TelemetryError:  # a name no node can have: not an answer
            continue
    return found


__all__ = [
    "ACTED",
    "VERSION",
    "Advice",
    "acted_event",
    "acted_of",
    "decode",
    "publish",
    "read",
    "withdraw",
]
