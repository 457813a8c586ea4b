"""The Redis key schema, in one place.

Every key starts with ``stg:``. Keys of one job carry the hash tag ``{JOB}`` so that a job's keys
live in one Redis Cluster slot (pipelines and multi-key commands stay on one shard). Names that
come from outside (job ids, node names) are validated before they become part of a key.
"""

from __future__ import annotations

import re

from slurm_plugin.errors import TelemetryError

PREFIX = "stg:"

# Slurm job ids are numbers; array and het-job forms (123_4, 123+1) are accepted too.
_JOB_ID = re.compile(r"^[0-9]{1,20}(?:[_+][0-9]{1,10})?")
# Hostnames, plus the characters Slurm node names use in practice.
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

#: How long a running job's keys live without a refresh (the reporter refreshes them).
JOB_TTL_ACTIVE_S = 7 * 24 * 3600
#: How long a finished job's keys are kept for export and audit (set by the epilog).
JOB_TTL_FINISHED_S = 24 * 3600
#: Approximate cap (entries) of a job's steps stream when the world size is unknown; an entry
#: holds one rank's flush (about 10 records at 10 steps/s and one flush per second).
STEPS_MAXLEN = 100_000
#: Seconds of flushes the steps stream keeps per rank (the service reads it every cycle).
STEPS_KEEP_S = 60
_STEPS_MAXLEN_BOUNDS = (10_000, 2_000_000)
#: Approximate cap of a job's GPU-sample and event streams.
GPU_MAXLEN = 50_000
EVENTS_MAXLEN = 10_000
DECISIONS_MAXLEN = 100_000


def steps_maxlen(world_size: int, flush_interval_s: float = 1.0) -> int:
    """The steps-stream cap for a job: ``STEPS_KEEP_S`` seconds of flushes from every rank,
    within fixed bounds, so Redis memory stays bounded whatever the job size."""
    wanted = int(max(1, world_size) * STEPS_KEEP_S / max(flush_interval_s, 0.01))
    low, high = _STEPS_MAXLEN_BOUNDS
    return min(high, max(low, wanted))


def check_job_id(job_id: str) -> str:
    """Return ``job_id`` when it is a valid Slurm job id, else raise :class:`TelemetryError`."""
    if not _JOB_ID.fullmatch(job_id):
        raise TelemetryError(f"invalid job id {job_id[:40]!r}")
    return job_id


def is_name(name: str) -> bool:
    """``name`` is valid as a policy name (what :func:`policy` takes)."""
    return bool(_NAME.fullmatch(name))


def check_node(node: str) -> str:
    """Return ``node`` when it is a valid node name, else raise :class:`TelemetryError`."""
    if not _NODE.fullmatch(node):
        raise TelemetryError(f"invalid node name {node[:40]!r}")
    return node


def _job(job_id: str, suffix: str) -> str:
    return f"{PREFIX}job:{{{check_job_id(job_id)}}}:{suffix}"


def job_meta(job_id: str) -> str:
    """Hash: the job's registration (nodes, world size, policy, user, attempt)."""
    return _job(job_id, "meta")


def job_steps(job_id: str) -> str:
    """Stream: the ranks' step timings, one entry per rank flush."""
    return _job(job_id, "steps")


def job_gpu(job_id: str) -> str:
    """Stream: sidecar samples per node and GPU."""
    return _job(job_id, "gpu")


def job_events(job_id: str) -> str:
    """Stream: events reported by the job (checkpoint begin/end, telemetry drops...)."""
    return _job(job_id, "events")


def job_advice(job_id: str) -> str:
    """String: the service's advice to the job (JSON: which nodes to leave, why, until when;
    store/advice.py), readable with the job's own credential."""
    return _job(job_id, "advice")


def job_credential(job_id: str) -> str:
    """String: the password of the job's ACL user (admin-only; see telemetry.credentials)."""
    return _job(job_id, "credential")


def job_streams(job_id: str) -> list[str]:
    """The keys a job's own credential may append to (and refresh the TTL of)."""
    return [job_steps(job_id), job_events(job_id), job_gpu(job_id)]


def job_keys(job_id: str) -> list[str]:
    """Every key of one job (for expiry and clean-up)."""
    return [
        job_meta(job_id),
        job_steps(job_id),
        job_gpu(job_id),
        job_events(job_id),
        job_service(job_id),
        job_advice(job_id),
    ]


def job_service(job_id: str) -> str:
    """Hash: the service's own state for a job (cursors, evictions, waiting decision)."""
    return _job(job_id, "service")


def job_decisions(job_id: str) -> str:
    """Set: the ids of a job's decisions (``job show``, ``job_decisions``)."""
    return _job(job_id, "decisions")


def node(name: str) -> str:
    """Hash: a node's history and last check result."""
    return f"{PREFIX}node:{check_node(name)}"


def policy(name: str) -> str:
    """String: a validated policy as JSON."""
    if not is_name(name):
        raise TelemetryError(f"invalid policy name {name[:40]!r}")
    return f"{PREFIX}policy:{name}"


def decision(decision_id: str) -> str:
    """Hash: one decision's action state machine."""
    if not _NAME.fullmatch(decision_id):
        raise TelemetryError(f"invalid decision id {decision_id[:40]!r}")
    return f"{PREFIX}decision:{decision_id}"


DECISIONS = f"{PREFIX}decisions"
#: String: the version of this key layout. ``serve`` writes it into an empty Redis and refuses
#: to start on any other (docs/deploy.md, upgrade and rollback).
SCHEMA = f"{PREFIX}schema"
SCHEMA_VERSION = 1
DECISIONS_OPEN = f"{PREFIX}decisions:open"
#: Set: the names of the policies applied through Redis (each one's JSON at ``policy(name)``),
#: so that the service reads them without scanning the keyspace every cycle.
POLICY_NAMES = f"{PREFIX}policies"
#: Sorted set: decision id -> when its job was requeue-held (the hourly eviction budget).
EVICTIONS = f"{PREFIX}evictions"
#: Evictions older than this leave EVICTIONS (the budget looks one hour back).
EVICTIONS_KEEP_S = 7 * 24 * 3600
BREAKER = f"{PREFIX}breaker"
#: Sorted set: node -> when it was last flagged a compute straggler (the breaker's window: a
#: restarted service goes on counting where the last one stopped).
BREAKER_WINDOW = f"{PREFIX}breaker:window"
#: Lists: the node hooks' requests waiting, and those the service took and has not finished
#: (store/hooks.py); one hash tag, one Redis Cluster slot (a request moves between them).
HOOKS = f"{PREFIX}{{hooks}}"
HOOKS_RUNNING = f"{PREFIX}{{hooks}}:running"
PAUSE = f"{PREFIX}pause"
LEADER = f"{PREFIX}leader"
HEARTBEAT = f"{PREFIX}heartbeat"
