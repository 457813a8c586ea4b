"""In-job step reporter: the training thread appends to a buffer; a thread flushes to Redis.

The golden rule: telemetry never slows down or breaks training. ``record()`` only appends a
tuple to a bounded deque (no validation, no I/O, no lock); a daemon thread validates, packs
and publishes in batches, keeps failed batches for retry within the same bound, drops the
oldest records beyond it (counting them), and backs off while Redis is away.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
import tomllib
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog

from slurm_plugin.errors import StragglerError, TelemetryError
from slurm_plugin.model import keys
from slurm_plugin.model.records import (
    RawStep,
    check_group,
    encode_json_entry,
    encode_steps,
    normalise_raw,
)
from slurm_plugin.store import credentials
from slurm_plugin.store.telemetry_store import TelemetryStore, connect_from
from slurm_plugin.telemetry.job_env import rank_env
from slurm_plugin.telemetry.outlet import Destination, Outlet
from slurm_plugin.telemetry.timers import PhaseTimer, StepTimer

log = structlog.get_logger(__name__)

PHASES = ("compute", "comm", "data")
_STEPS_PER_ENTRY = 100
_TTL_REFRESH_S = 300.0
_live: weakref.WeakSet[StepReporter] = weakref.WeakSet()
_disabled_logged = False


@dataclass(frozen=True)
class _Entry:
    """A steps entry waiting to be stored: its fields, its steps and its flush id."""

    fields: dict[str, str]
    raws: list[RawStep]
    flush: str


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _after_fork_in_child() -> None:
    # A forked child (a dataloader worker) must not share the parent's buffer or believe the
    # parent's flusher thread runs for it: its reporters become inert.
    for reporter in list(_live):
        reporter._become_inert()


os.register_at_fork(after_in_child=_after_fork_in_child)


class StepReporter:
    """Publishes one rank's per-step timings to Redis without ever blocking the caller.

    Build it with :meth:`from_env` inside a Slurm job. ``record()`` is safe to call from the
    training loop; ``close()`` (or leaving the ``with`` block) flushes what is left.
    """

    def __init__(
        self,
        job_id: str,
        rank: int,
        node: str,
        gpu: int = 0,
        *,
        store_factory: Callable[[], TelemetryStore] | None = None,
        attempt: int = 0,
        world_size: int = 0,
        flush_interval_s: float = 1.0,
        buffer_records: int = 100_000,
        backoff_s: tuple[float, float] = (0.5, 15.0),
        enabled: bool = True,
        group: str = "",
        relay_socket: Path | None = None,
    ) -> None:
        self.job_id = keys.check_job_id(job_id) if enabled else job_id
        self.node = keys.check_node(node) if enabled else node
        self.rank = rank
        self.gpu = gpu
        self.attempt = attempt
        #: The rank's peer group (ranks that do the same work, e.g. ``stage3``): the detector
        #: compares ranks within their group. "" when every rank does the same work.
        self.group = check_group(group) if enabled and group else ""
        self.enabled = enabled and store_factory is not None
        self._store: Destination | None = None
        #: Where flushes go: the node relay's socket while a relay answers on it, Redis
        #: directly otherwise (and for good once the relay refuses this process).
        self._outlet = (
            Outlet(store_factory, relay_socket, job_id=job_id, rank=rank)
            if store_factory is not None
            else None
        )
        self._cap = buffer_records
        self._buf: deque[tuple[Any, ...]] = deque(maxlen=buffer_records)
        self._events: deque[dict[str, Any]] = deque(maxlen=1000)
        # Entries not yet stored, encoded with their steps: a failed flush is sent again as it
        # was (encoded once, same flush ids), never re-encoded or stored twice.
        self._pending: list[_Entry] = []
        # The flush id of each entry: this reporter's random session and a sequence number;
        # the service drops an entry whose id it has already read (a retried flush that Redis
        # had stored before the client gave up on it).
        self._session = secrets.token_hex(8)
        self._seq = 0
        self._interval = flush_interval_s
        self._steps_maxlen = keys.steps_maxlen(world_size, flush_interval_s) if world_size else None
        self._backoff = backoff_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_step = 0
        self._phase_s: list[float | None] = [None, None, None]
        self._phase_timers = {name: PhaseTimer(self, i) for i, name in enumerate(PHASES)}
        self._last_ttl_refresh = -math.inf
        self._redis_down = False
        self._busy = False  # the flusher holds drained records it has not yet stored
        # Counters (read them; the flusher thread and record() update them).
        self.dropped = 0
        self.invalid = 0
        self.invalid_events = 0
        self.published = 0
        self._dropped_reported = 0
        if not self.enabled:
            self.record = _noop  # type: ignore[method-assign]
            self.event = _noop  # type: ignore[method-assign]
            return
        _live.add(self)
        self._thread = threading.Thread(target=self._run, name="straggler-reporter", daemon=True)
        self._thread.start()

    # -- construction from the job's environment ----------------------------------------------
    @classmethod
    def disabled(cls, reason: str) -> StepReporter:
        """A reporter that does nothing; logs ``reason`` once per process."""
        global _disabled_logged  # noqa: PLW0603 - one log line per process, by design
        if not _disabled_logged:
            log.info("telemetry.disabled", reason=reason)
            _disabled_logged = True
        return cls("0", 0, "none", enabled=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StepReporter:
        """The reporter for this process, from Slurm's (or torchrun's) environment.

        Outside a job, with telemetry disabled, or with a malformed environment or settings,
        it returns a reporter that does nothing and logs why once. It never raises.
        """
        from slurm_plugin.config import load_settings  # noqa: PLC0415 - keep import light

        env = os.environ if env is None else env
        job_id = env.get("SLURM_JOB_ID", "")
        if not job_id:
            return cls.disabled("not inside a Slurm job (SLURM_JOB_ID is not set)")
        try:
            settings = credentials.job_settings(job_id, env, load_settings)
            if not settings.telemetry.enabled:
                return cls.disabled("[telemetry] enabled is false")
            where = rank_env(env)
            connect_from(settings)  # validates the URL and TLS settings, sends nothing
            return cls(
                job_id,
                where.rank,
                where.node,
                where.gpu,
                attempt=where.attempt,
                world_size=where.world,
                store_factory=lambda: TelemetryStore(connect_from(settings, retries=0)),
                flush_interval_s=settings.telemetry.flush_interval_s,
                buffer_records=settings.telemetry.buffer_records,
                group=where.group,
                relay_socket=settings.telemetry.relay_socket,
            )
        except StragglerError as exc:
            return cls.disabled(f"telemetry misconfigured: {exc}")
        except (OSError, tomllib.TOMLDecodeError) as exc:
            return cls.disabled(f"job credential file unusable: {exc}")

    # -- the training thread's API (hot path) ---------------------------------------------
    def record(
        self,
        step: int,
        step_s: float,
        compute_s: float | None = None,
        comm_s: float | None = None,
        data_s: float | None = None,
    ) -> None:
        """Buffer one step's timings. Never blocks, never raises; validated by the flusher."""
        buf = self._buf
        if len(buf) == self._cap:
            self.dropped += 1
        buf.append((step, time.time(), step_s, compute_s, comm_s, data_s))

    def step(self, step: int | None = None) -> StepTimer:
        """``with rep.step():`` times one step and records it (steps count from 0)."""
        return StepTimer(self, step)

    def phase(self, name: str) -> PhaseTimer:
        """``with rep.phase("compute"|"comm"|"data"):`` inside ``rep.step()``."""
        try:
            return self._phase_timers[name]
        except KeyError:
            raise ValueError(f"unknown phase {name!r}; use one of {PHASES}") from None

    def event(self, name: str, **fields: Any) -> None:
        """Report a job event (e.g. ``checkpoint_begin``/``checkpoint_end`` with ``step=``).
        The flusher refuses (and counts in ``invalid_events``) one whose fields are not plain
        finite values, such as ``loss=float("nan")``; the steps around it are published."""
        self._events.append(
            {**fields, "name": str(name), "ts": time.time(), "rank": self.rank, "node": self.node}
        )

    # -- lifecycle -----------------------------------------------------------------------------
    def flush(self, timeout_s: float = 5.0) -> bool:
        """Ask the flusher to publish now and wait (at most ``timeout_s``) until the buffer is
        empty; True when everything buffered so far was published."""
        if not self.enabled or self._thread is None:
            return True
        deadline = time.monotonic() + timeout_s
        while self._unpublished() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.01)
        return not self._unpublished()

    def _unpublished(self) -> bool:
        # While the flusher publishes, the records are in its hands, not in the buffers: an
        # empty buffer then does not mean stored (a flush during an outage said True).
        return bool(self._busy or self._buf or self._pending or self._events)

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is buffered (waiting at most ``timeout_s``) and stop the flusher."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        thread.join(timeout_s)
        _live.discard(self)
        Outlet.close(self._store)
        self._store = None
        if not thread.is_alive():
            self._count_lost()

    def _count_lost(self) -> None:
        """After the last flush: what it could not publish is gone with the process; count it
        in ``dropped`` and say so (nothing is left to publish the count)."""
        lost = len(self._buf) + sum(len(e.raws) for e in self._pending)
        if lost == 0:
            return
        self.dropped += lost
        self._buf.clear()
        self._pending = []
        log.warning(
            "telemetry.lost_at_close",
            job_id=self.job_id,
            rank=self.rank,
            lost=lost,
            dropped_total=self.dropped,
            hint="neither the relay nor Redis took the last flush",
        )

    def __enter__(self) -> StepReporter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _become_inert(self) -> None:
        self._buf = deque(maxlen=1)
        self._pending = []
        self._busy = False  # the parent's flusher may have been mid-flush at the fork
        self._thread = None
        self.enabled = False
        self.record = _noop  # type: ignore[method-assign]
        self.event = _noop  # type: ignore[method-assign]

    # -- the flusher thread -------------------------------------------------------------------
    def _run(self) -> None:
        delay = self._interval
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            stopping = self._stop.is_set()
            self._busy = True
            try:
                ok = self._flush_once()
            except Exception:
                log.exception("telemetry.flush_crashed", job_id=self.job_id, rank=self.rank)
                ok = False
            finally:
                self._busy = False
            if stopping:
                return
            if ok:
                delay = self._interval
            else:
                delay = min(self._backoff[1], max(self._backoff[0], delay * 2))

    def _drain(self) -> list[RawStep]:
        batch: list[RawStep] = []
        buf = self._buf
        invalid_before = self.invalid
        while buf:
            raw = normalise_raw(buf.popleft())
            if raw is None:
                self.invalid += 1
            else:
                batch.append(raw)
        if self.invalid > invalid_before:
            log.warning(
                "telemetry.invalid_values",
                job_id=self.job_id,
                rank=self.rank,
                dropped_now=self.invalid - invalid_before,
                dropped_total=self.invalid,
                detail="step must be an integer >= 0; durations finite and >= 0",
            )
        return batch

    def _valid_events(self) -> list[dict[str, Any]]:
        """The buffered events, less those that can never be stored (counted, logged, gone:
        sent again they would fail every flush after them)."""
        events = []
        while self._events:
            event = self._events.popleft()
            try:
                encode_json_entry(event)
            except TelemetryError as exc:
                self.invalid_events += 1
                log.warning(
                    "telemetry.invalid_event",
                    job_id=self.job_id,
                    rank=self.rank,
                    event_name=str(event.get("name"))[:64],
                    error=str(exc),
                    refused_total=self.invalid_events,
                )
                continue
            events.append(event)
        return events

    def _entry(self, raws: list[RawStep], flush: str) -> _Entry:
        fields = encode_steps(
            self.rank, self.node, self.gpu, self.attempt, raws, self.group, flush=flush
        )
        return _Entry(fields, raws, flush)

    def _encode(self, batch: list[RawStep]) -> list[_Entry]:
        """``batch`` as steps entries, each with its own flush id."""
        entries = []
        for i in range(0, len(batch), _STEPS_PER_ENTRY):
            self._seq += 1
            entries.append(
                self._entry(batch[i : i + _STEPS_PER_ENTRY], f"{self._session}.{self._seq}")
            )
        return entries

    def _bounded(self, entries: list[_Entry]) -> list[_Entry]:
        """Keep at most ``buffer_records`` records, the newest; count the rest as dropped. An
        entry cut in part keeps its flush id (if Redis had stored it whole, the service reads
        that one and skips this)."""
        excess = sum(len(e.raws) for e in entries) - self._cap
        while entries and excess > 0:
            oldest = entries[0]
            cut = min(excess, len(oldest.raws))
            if cut == len(oldest.raws):
                entries.pop(0)
            else:
                entries[0] = self._entry(oldest.raws[cut:], oldest.flush)
            excess -= cut
            self.dropped += cut
        return entries

    def _flush_once(self) -> bool:
        retrying = bool(self._pending)
        pending = self._bounded(self._pending + self._encode(self._drain()))
        self._pending = []
        events = self._valid_events()
        lost = self.dropped - self._dropped_reported
        if not pending and not events and not lost:
            return True
        assert self._outlet is not None  # noqa: S101 - enabled implies a store factory
        if self._store is None:
            try:
                self._store = self._outlet.connect()
            except StragglerError as exc:
                return self._failed(pending, events, exc)
        elif not retrying:
            self._store = self._outlet.reconsider(self._store)
        now = time.monotonic()
        refresh = now - self._last_ttl_refresh > _TTL_REFRESH_S
        if lost:
            events.append(
                {
                    "name": "telemetry_dropped",
                    "ts": time.time(),
                    "rank": self.rank,
                    "node": self.node,
                    "dropped": lost,
                    "invalid": self.invalid,
                    "invalid_events": self.invalid_events,
                }
            )
        try:
            refused = self._publish(pending, events, refresh)
        except StragglerError as exc:
            kept = [e for e in events if e["name"] != "telemetry_dropped"]
            return self._failed(pending, kept, exc)
        except Exception as exc:  # a surprise, not Redis: keep the steps (bounded), not events
            log.exception("telemetry.publish_crashed", job_id=self.job_id, rank=self.rank)
            return self._failed(pending, [], exc)
        if refresh:
            self._last_ttl_refresh = now
        self.invalid_events += refused or 0
        self.published += sum(len(e.raws) for e in pending)
        self._dropped_reported += lost
        if self._redis_down:
            self._redis_down = False
            log.warning(
                "telemetry.reconnected",
                job_id=self.job_id,
                rank=self.rank,
                dropped=lost,
                invalid=self.invalid,
            )
        return True

    def _publish(self, pending: list[_Entry], events: list[dict[str, Any]], refresh: bool) -> int:
        """Publish one flush where the outlet says; when the relay turned us away (or refused
        the flush: it stored nothing), to Redis at once, not a backoff later."""
        outlet, store = self._outlet, self._store
        assert outlet is not None  # noqa: S101 - enabled implies a store factory
        assert store is not None  # noqa: S101 - the caller connected
        steps = [e.fields for e in pending]
        try:
            return store.publish(
                self.job_id, steps, events, refresh_ttl=refresh, steps_maxlen=self._steps_maxlen
            )
        except StragglerError as exc:
            if not outlet.sent_nothing(exc):
                raise
            self._store = outlet.failed(store, exc)
        self._store = outlet.connect()
        return self._store.publish(
            self.job_id, steps, events, refresh_ttl=refresh, steps_maxlen=self._steps_maxlen
        )

    def _failed(
        self,
        pending: list[_Entry],
        events: list[dict[str, Any]],
        exc: Exception,
    ) -> bool:
        if self._outlet is not None:
            self._store = self._outlet.failed(self._store, exc)
        self._pending = pending
        for event in reversed(events):
            self._events.appendleft(event)
        if not self._redis_down:
            self._redis_down = True
            log.warning(
                "telemetry.redis_unavailable",
                job_id=self.job_id,
                rank=self.rank,
                error=str(exc),
                buffered=sum(len(e.raws) for e in pending),
            )
        return False


__all__ = ["PHASES", "StepReporter"]
