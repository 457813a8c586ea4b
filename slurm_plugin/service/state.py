"""The service's state in Redis: decisions and audit, node history, per-job state, pause,
circuit breaker, leader lock and heartbeat. One class, so every key goes through keys.py."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import structlog
from redis.exceptions import LockError, LockNotOwnedError
from redis.lock import Lock
from redis.sentinel import SentinelConnectionPool

from slurm_plugin.errors import ConfigError
from slurm_plugin.model import keys
from slurm_plugin.policy.history import NodeHistory
from slurm_plugin.store import decision as decision_record
from slurm_plugin.store import job_state, registration
from slurm_plugin.store import nodes as node_store
from slurm_plugin.store.decision import DecisionRecord
from slurm_plugin.store.job_state import JobState
from slurm_plugin.store.nodes import NodeRecord
from slurm_plugin.store.registration import Registration
from slurm_plugin.store.telemetry_store import RedisClient

log = structlog.get_logger(__name__)

#: A job's service state has its TTL set again at most this often by one instance (each cycle
#: writes every running job's cursors: 2,000 EXPIREs a cycle at 2,000 jobs otherwise).
JOB_TTL_REFRESH_S = 3600.0
#: Seconds between two scans for applied policies that the name index may not list (applied
#: by a release before it); between them the index alone is read.
POLICY_SCAN_EVERY_S = 60.0
#: How long a decision waits for a replica to have it before Slurm is touched (Sentinel).
REPLICA_WAIT_MS = 1000
OPEN_STATES = {"planned", "held", "excluded", "released", "waiting"}
#: A decision's states in the order they happen: a write that would move a decision back (an
#: instance that lost the lead while Slurm was slow, writing what it saw before) is dropped.
_STATE_ORDER = {
    "waiting": 0,
    "planned": 0,
    "held": 1,
    "excluded": 2,
    "released": 3,
    "verified": 4,
    "failed": 4,
    "abandoned": 4,
    "recorded": 4,
    "acted": 4,
}


class ServiceState:
    """Redis-backed state; the client must decode responses to text."""

    def __init__(
        self,
        client: RedisClient,
        clock: Any = time.time,
        *,
        retention_s: float = 90 * 24 * 3600.0,
    ) -> None:
        self.client = client
        self.clock = clock
        self.retention_s = int(retention_s)
        #: Per job, when this instance last set the TTL of its service state (monotonic).
        self._ttl_set: dict[str, float] = {}
        #: When this instance last scanned for applied policies (``applied_policies``).
        self._policies_scanned_at = -math.inf

    # -- decisions and audit -----------------------------------------------------------------
    def save_decision(self, decision_id: str, fields: dict[str, Any]) -> None:
        """Create or update a decision; every change is appended to the audit stream. A state
        never moves back (``held`` after ``verified`` is dropped, with a warning)."""
        now = self.clock()
        state = fields.get("state")
        if state is not None:
            current = cast("str | None", self.client.hget(keys.decision(decision_id), "state"))
            if _STATE_ORDER.get(str(state), 0) < _STATE_ORDER.get(current or "", 0):
                log.warning("state.stale_write", decision_id=decision_id, state=state, was=current)
                return
        flat = decision_record.encode(fields)  # a field the record does not name: an error
        flat["updated_at"] = f"{now:.3f}"
        # Every audit entry names its job, node and action, so filtering the audit by job finds
        # all the state changes of a decision, and each row says what it was about.
        named = ("job_id", "node", "action")
        if any(name not in flat for name in named):
            known = cast("list[str | None]", self.client.hmget(keys.decision(decision_id), named))
            for name, value in zip(named, known, strict=True):
                if value is not None:
                    flat.setdefault(name, value)
        if state == "held":
            flat.setdefault("held_ts", f"{now:.3f}")
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(keys.decision(decision_id), mapping=cast("dict[Any, Any]", flat))
        pipe.expire(keys.decision(decision_id), self.retention_s)
        if "job_id" in flat:
            pipe.sadd(keys.job_decisions(flat["job_id"]), decision_id)
            pipe.expire(keys.job_decisions(flat["job_id"]), self.retention_s)
        if state == "held":  # the job was requeued: one eviction for the hourly budget
            pipe.zadd(keys.EVICTIONS, {decision_id: now})
            pipe.zremrangebyscore(keys.EVICTIONS, "-inf", now - keys.EVICTIONS_KEEP_S)
        if state in OPEN_STATES:
            pipe.sadd(keys.DECISIONS_OPEN, decision_id)
        elif state is not None:
            pipe.srem(keys.DECISIONS_OPEN, decision_id)
        entry: dict[Any, Any] = {"id": decision_id, **flat}
        pipe.xadd(
            keys.DECISIONS,
            entry,
            maxlen=keys.DECISIONS_MAXLEN,
            approximate=True,
        )
        pipe.execute()

    def decision(self, decision_id: str) -> dict[str, str]:
        """One decision's fields, as text (what the CLI shows)."""
        return cast("dict[str, str]", self.client.hgetall(keys.decision(decision_id)))

    def record(self, decision_id: str) -> DecisionRecord:
        """One decision, typed (an unknown id: every field None)."""
        return decision_record.read(self.decision(decision_id), decision_id)

    def open_records(self) -> list[DecisionRecord]:
        """:meth:`open_decisions`, typed."""
        return [decision_record.read(d, d["id"]) for d in self.open_decisions()]

    def replicated(self, timeout_ms: int = REPLICA_WAIT_MS) -> int | None:
        """Behind Sentinel, wait (Redis ``WAIT``, at most ``timeout_ms``) until a replica has
        every write so far, so that a decision planned before Slurm is touched survives a
        failover; returns how many replicas have it. None for a server without Sentinel (a
        Redis Cluster or one server: nothing to wait for)."""
        pool = getattr(self.client, "connection_pool", None)
        if not isinstance(pool, SentinelConnectionPool):
            return None
        client: Any = self.client
        copies = int(client.execute_command("WAIT", 1, timeout_ms))
        if copies < 1:
            log.warning(
                "state.not_replicated",
                timeout_ms=timeout_ms,
                hint="no replica acknowledged the decision: a failover now would lose it "
                "(Slurm's marks still say what was done; the service reconciles from them)",
            )
        return copies

    def open_decisions(self) -> list[dict[str, str]]:
        """Decisions that have not reached a final state."""
        ids = sorted(cast("set[str]", self.client.smembers(keys.DECISIONS_OPEN)))
        return self._decisions(ids, keep_empty=True)

    def _decisions(self, ids: list[str], *, keep_empty: bool) -> list[dict[str, str]]:
        """The decisions ``ids`` with their fields, in one round trip (the service reads the
        open ones several times a cycle)."""
        pipe = self.client.pipeline(transaction=False)
        for decision_id in ids:
            pipe.hgetall(keys.decision(decision_id))
        found = zip(ids, cast("list[dict[str, str]]", pipe.execute()), strict=True)
        return [{"id": i, **fields} for i, fields in found if fields or keep_empty]

    def audit(
        self,
        since: float = 0.0,
        job_id: str | None = None,
        count: int = 1000,
        *,
        after: str | None = None,
    ) -> list[dict[str, str]]:
        """Up to ``count`` audit entries (every state change), oldest first, from ``since`` or
        after the entry ``after`` (each entry's ``audit_id``: pass the last one to page on).
        Reads the stream in pages, so a job's entries are found however many others came
        first, in bounded memory."""
        out: list[dict[str, str]] = []
        start = f"({after}" if after else f"{int(since * 1000)}-0"
        while len(out) < count:
            page = cast(
                "list[tuple[str, dict[str, str]]]",
                self.client.xrange(keys.DECISIONS, min=start, count=1000),
            )
            for entry_id, fields in page:
                if job_id is None or fields.get("job_id") == job_id:
                    out.append({"audit_id": entry_id, **fields})
                    if len(out) == count:
                        break
            if len(page) < 1000:
                break
            start = f"({page[-1][0]}"
        return out

    def job_decisions(self, job_id: str) -> list[dict[str, str]]:
        """A job's decisions with their latest fields (``held_ts``: when the job was requeued),
        ordered by detection time; decisions past their retention are gone."""
        ids = sorted(cast("set[str]", self.client.smembers(keys.job_decisions(job_id))))
        decisions = self._decisions(ids, keep_empty=False)
        return sorted(
            decisions, key=lambda d: float(d.get("detected_ts") or d.get("updated_at") or 0)
        )

    def job_records(self, job_id: str) -> list[DecisionRecord]:
        """:meth:`job_decisions`, typed."""
        return [decision_record.read(d, d["id"]) for d in self.job_decisions(job_id)]

    def evictions_since(self, since: float) -> int:
        """Evictions (jobs requeue-held by us) since ``since``, for the hourly budget."""
        return int(self.client.zcount(keys.EVICTIONS, since, "+inf"))

    def restore_eviction(self, decision_id: str, when: float, now: float) -> bool:
        """Count an eviction Redis lost (Slurm still shows its mark) in the hourly budget
        from ``when``; False when it is counted already or too old to matter."""
        if when < now - keys.EVICTIONS_KEEP_S:
            return False
        return bool(self.client.zadd(keys.EVICTIONS, {decision_id: when}, nx=True))

    # -- per-job state -------------------------------------------------------------------------
    def job(self, job_id: str) -> dict[str, str]:
        """The service's state for a job (cursors, evictions...), as text."""
        return cast("dict[str, str]", self.client.hgetall(keys.job_service(job_id)))

    def job_state(self, job_id: str) -> JobState:
        """The service's state for a job, typed."""
        return job_state.read(self.job(job_id))

    def job_states(self, job_ids: Sequence[str]) -> dict[str, JobState]:
        """:meth:`job_state` of many jobs, in one round trip."""
        return {i: job_state.read(raw) for i, raw in self.jobs(job_ids).items()}

    def jobs(self, job_ids: Sequence[str]) -> dict[str, dict[str, str]]:
        """The service's state for many jobs, in one round trip."""
        return self._hashes(job_ids, keys.job_service)

    def _hashes(
        self, job_ids: Sequence[str], key: Callable[[str], str]
    ) -> dict[str, dict[str, str]]:
        """Per job, the hash at ``key(job_id)``, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(key(job_id))
        return dict(zip(job_ids, cast("list[dict[str, str]]", pipe.execute()), strict=True))

    def update_job(self, job_id: str, **fields: Any) -> None:
        """Merge fields into the job's service state."""
        self.update_jobs({job_id: fields})

    def update_jobs(self, updates: Mapping[str, Mapping[str, Any]]) -> None:
        """:meth:`update_job` of many jobs, in one round trip. The state lives
        ``JOB_TTL_ACTIVE_S`` past its last update, give or take ``JOB_TTL_REFRESH_S``: the TTL
        is set again only that often (and on a key it may not have: the first write of the
        job here, after :meth:`forget_job`)."""
        now = time.monotonic()
        pipe = self.client.pipeline(transaction=False)
        for job_id, fields in updates.items():
            if not fields:
                continue
            key = keys.job_service(job_id)
            pipe.hset(key, mapping=cast("dict[Any, Any]", job_state.encode(fields)))
            if now - self._ttl_set.get(job_id, -math.inf) >= JOB_TTL_REFRESH_S:
                pipe.expire(key, keys.JOB_TTL_ACTIVE_S)
                self._ttl_set[job_id] = now
        pipe.execute()
        if len(self._ttl_set) > 2 * len(updates) + 4096:  # jobs long gone: forgotten
            self._ttl_set = {j: t for j, t in self._ttl_set.items() if now - t < JOB_TTL_REFRESH_S}

    def job_metas(self, job_ids: Sequence[str]) -> dict[str, Registration]:
        """:meth:`job_meta` of many jobs, in one round trip."""
        return registration.read_many(self.client, job_ids)

    def forget_job(self, job_id: str) -> None:
        """Drop the service's state for a job id (Slurm gave it to another job): counts,
        cooldown, cursors, waiting. Its decisions stay in the audit, their job index too."""
        self.client.delete(keys.job_service(job_id))
        self._ttl_set.pop(job_id, None)

    def uncount_eviction(self, job_id: str) -> None:
        """An eviction counted before acting never happened: give the job its count back."""
        key = keys.job_service(job_id)
        if int(self.client.hincrby(key, "evictions", -1)) < 0:
            self.client.hset(key, "evictions", "0")
        self.client.hset(key, "last_eviction_ts", "")

    def count_ignored(self, job_id: str, dropped: Mapping[str, int]) -> None:
        """Add to the job's counts of telemetry records not believed, by reason."""
        key = keys.job_service(job_id)
        pipe = self.client.pipeline(transaction=False)
        for reason, count in dropped.items():
            pipe.hincrby(key, f"ignored_{reason}", count)
        pipe.execute()

    def node(self, node: str) -> dict[str, str]:
        """A node's whole record (``telemetry.node_record`` names its fields)."""
        return NodeRecord(self.client, node).fields()

    def job_meta(self, job_id: str) -> Registration:
        """The job's registration (prolog); empty when none."""
        return registration.read(self.client, job_id)

    # -- nodes -----------------------------------------------------------------------------------
    def node_history(self, node: str) -> NodeHistory:
        """A node's history (empty when unknown or unreadable)."""
        return NodeRecord(self.client, node).history()

    def node_histories(self, nodes: Sequence[str]) -> list[NodeHistory]:
        """The histories of ``nodes`` in one round trip."""
        return node_store.histories(self.client, nodes)

    def save_node_history(self, history: NodeHistory) -> None:
        """Persist a node's history and its state for quick listing."""
        NodeRecord(self.client, history.node).save_history(history, self.clock())

    def nodes(self) -> list[NodeHistory]:
        """Every node with a history."""
        found = []
        for key in self.client.scan_iter(match=f"{keys.PREFIX}node:*", count=500):
            name = str(key).split(":", 2)[2]
            try:
                found.append(self.node_history(name))
            except Exception as exc:  # noqa: BLE001 - a bad key must not hide the others
                log.warning("state.bad_node_key", key=str(key)[:80], error=str(exc))
        return sorted(found, key=lambda h: h.node)

    # -- applied policies and prolog findings ----------------------------------------------
    def apply_policy(self, name: str, policy_json: str) -> None:
        """Store a validated policy; it overrides the file of the same name."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(keys.policy(name), policy_json)
        pipe.sadd(keys.POLICY_NAMES, name)
        pipe.execute()

    def revert_policy(self, name: str) -> bool:
        """Drop an applied policy (the file of that name, if any, counts again); False when
        none was applied under ``name``."""
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(keys.policy(name))
        pipe.srem(keys.POLICY_NAMES, name)
        deleted, _ = pipe.execute()
        return bool(deleted)

    def applied_policies(self) -> dict[str, str]:
        """Policies applied through Redis, as JSON by name: those the name index lists (one
        round trip, not a scan of the keyspace: the service reads them every cycle), and every
        ``POLICY_SCAN_EVERY_S`` (and at this instance's first read) those a scan finds, which
        covers a policy a release before the index applied; the index is mended then."""
        now = self.clock()
        since = now - self._policies_scanned_at
        scan = since >= POLICY_SCAN_EVERY_S or since < 0
        if scan:
            prefix = f"{keys.PREFIX}policy:"
            listed = {str(key)[len(prefix) :] for key in self.client.scan_iter(f"{prefix}*", 200)}
        else:
            listed = cast("set[str]", self.client.smembers(keys.POLICY_NAMES))
        ordered = sorted(n for n in listed if keys.is_name(n))  # a stray key: not a policy
        if scan:
            if ordered:
                self.client.sadd(keys.POLICY_NAMES, *ordered)
            self._policies_scanned_at = now
        pipe = self.client.pipeline(transaction=False)
        for name in ordered:
            pipe.get(keys.policy(name))
        found = {}
        for name, raw in zip(ordered, pipe.execute(), strict=True):
            if raw:
                found[name] = cast("str", raw)
        return found

    def prolog_finding(self, node: str) -> tuple[str, float | None] | None:
        """What the prolog found when it last failed on ``node`` and when (it clears both when
        it passes), or None."""
        return NodeRecord(self.client, node).prolog_finding()

    def clear_prolog_finding(self, node: str) -> None:
        """The finding was used (or is stale): forget it."""
        NodeRecord(self.client, node).clear_prolog_finding()

    def refuse(self, node: str, decision_id: str, reason: str) -> None:
        """Ask every prolog on ``node`` to fail (so Slurm keeps it out) until forgiven. Only the
        service, after its rails, and an admin's `node mark ... persistent` write this."""
        NodeRecord(self.client, node).refuse(decision_id, reason, self.clock())

    def refusal(self, node: str) -> dict[str, Any] | None:
        """The standing refusal of ``node``, if any."""
        return NodeRecord(self.client, node).refusal()

    def withdraw_refusal(self, node: str) -> None:
        """Let prologs on ``node`` pass again."""
        NodeRecord(self.client, node).withdraw_refusal()

    # -- switches --------------------------------------------------------------------------------
    def pause(self, seconds: float, who: str = "") -> None:
        """Stop all actions for ``seconds`` (detection and audit go on)."""
        self.client.set(
            keys.PAUSE, json.dumps({"by": who, "at": self.clock()}), px=int(seconds * 1000)
        )

    def paused(self) -> float | None:
        """Seconds of pause left, or None."""
        ttl = int(self.client.pttl(keys.PAUSE))
        return ttl / 1000.0 if ttl and ttl > 0 else None

    def flag_for_breaker(self, node: str, now: float, window_s: float) -> int:
        """Note ``node`` flagged at ``now``; the distinct nodes flagged within ``window_s``."""
        pipe = self.client.pipeline(transaction=True)
        pipe.zadd(keys.BREAKER_WINDOW, {node: now})
        pipe.zremrangebyscore(keys.BREAKER_WINDOW, "-inf", f"({now - window_s}")
        pipe.zcard(keys.BREAKER_WINDOW)
        pipe.expire(keys.BREAKER_WINDOW, max(1, int(window_s) + 60))
        return int(pipe.execute()[2])

    def open_breaker(self, why: str) -> None:
        """Stop all actions until an admin resumes."""
        self.client.set(keys.BREAKER, json.dumps({"why": why, "at": self.clock()}))

    def breaker(self) -> str | None:
        """Why the circuit breaker is open, or None."""
        raw = cast("str | None", self.client.get(keys.BREAKER))
        return json.loads(raw)["why"] if raw else None

    def resume(self) -> None:
        """Lift a pause and close the circuit breaker."""
        self.client.delete(keys.PAUSE, keys.BREAKER)

    # -- leadership --------------------------------------------------------------------------
    def _leader_lock(self, instance: str, ttl_s: float) -> Lock:
        """redis-py's lock on ``stg:leader`` with ``instance`` as its token, so that every
        service cycle (a new object each time) speaks for the same owner, and `straggler
        status` can show who leads. Not thread-local: the fence reads it from any thread."""
        lock = Lock(self.client, keys.LEADER, timeout=max(ttl_s, 0.001), thread_local=False)
        lock.local.token = self.client.get_encoder().encode(instance)
        return lock

    def lead(self, instance: str, ttl_s: float) -> bool:
        """Take or keep the leader lock; True when ``instance`` leads. Taking is SET NX PX;
        keeping is redis-py's atomic reacquire (the TTL is reset only while the lock still
        holds our token), so two instances never both lead."""
        lock = self._leader_lock(instance, ttl_s)
        if lock.acquire(blocking=False, token=instance):
            return True
        try:
            return lock.reacquire()
        except LockNotOwnedError:
            return False

    def step_down(self, instance: str) -> bool:
        """Give the lock up (only if ``instance`` holds it), so a standby can lead."""
        try:
            self._leader_lock(instance, 1.0).release()
        except LockError:
            return False
        return True

    def check_schema(self) -> int:
        """The key layout's version in Redis. An empty or pre-versioning Redis (version 1 had
        no marker) is stamped with ours; any other version stops ``serve`` before it acts: a
        newer one was written by a newer release (roll that host forward, or restore Redis
        from before the upgrade), an older one needs a migration this release does not have."""
        self.client.set(keys.SCHEMA, keys.SCHEMA_VERSION, nx=True)
        raw = self.client.get(keys.SCHEMA)
        try:
            found = int(str(raw))
        except ValueError:
            found = -1
        if found != keys.SCHEMA_VERSION:
            raise ConfigError(
                f"Redis holds key layout (schema) version {str(raw)[:20]!r}, this release "
                f"uses {keys.SCHEMA_VERSION} (hint: upgrade or roll back as docs/deploy.md says; "
                f"never point two releases with different layouts at one Redis)",
                field="redis.url",
            )
        return found

    def leads(self, instance: str) -> bool:
        """The fence before every Slurm action: the lock still names ``instance``."""
        return bool(self.client.get(keys.LEADER) == instance)

    def heartbeat(self, instance: str, info: dict[str, Any]) -> None:
        """Say we are alive (read by `straggler status`)."""
        self.client.set(
            keys.HEARTBEAT, json.dumps({"instance": instance, "ts": self.clock(), **info}), ex=300
        )

    def last_heartbeat(self) -> dict[str, Any] | None:
        """The last heartbeat, if any."""
        raw = cast("str | None", self.client.get(keys.HEARTBEAT))
        return cast("dict[str, Any]", json.loads(raw)) if raw else None
