"""The Redis side of telemetry: publish batches, read a job's records back, expire a job.

Works unchanged against one redis-server and against Redis Cluster: a job's keys share the
hash tag ``{JOB}``, so every pipeline of one job stays on one shard.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import redis
import structlog
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from slurm_plugin.errors import RedisUnavailableError, TelemetryError
from slurm_plugin.model import keys, redis_url
from slurm_plugin.model.columns import decode_entries
from slurm_plugin.model.records import (
    StepRecord,
    decode_json_entry,
    encode_json_entry,
    flush_id,
    to_text,
)
from slurm_plugin.model.relayed import is_relayed
from slurm_plugin.store.sentinel import master_client

if TYPE_CHECKING:
    from slurm_plugin.config import Settings

log = structlog.get_logger(__name__)

RedisClient = redis.Redis | RedisCluster


@dataclass(frozen=True)
class Tls:
    """TLS material for ``rediss://`` URLs (None: the system trust store, no client cert)."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    def options(self) -> dict[str, Any]:
        """redis-py's ssl_* keyword arguments; the server's certificate is always verified."""
        options: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
        if self.ca_file is not None:
            options["ssl_ca_certs"] = str(self.ca_file)
        if self.cert_file is not None:
            options["ssl_certfile"] = str(self.cert_file)
        if self.key_file is not None:
            options["ssl_keyfile"] = str(self.key_file)
        return options


def connect(
    url: str,
    *,
    timeout_s: float = 2.0,
    cluster: bool = False,
    retries: int = 1,
    decode: bool = False,
    tls: Tls | None = None,
) -> RedisClient:
    """A client for ``url`` (``redis://``, ``rediss://``, or ``redis+sentinel://``: the
    master a set of Sentinels names, found again after a failover); a cluster client when
    asked.

    ``retries`` bounds redis-py's own retries of a failed command (its default, 10 with
    backoff, can hold a caller for seconds); callers with their own backoff pass 0. Nothing is
    sent until the first command; a malformed URL raises :class:`RedisUnavailableError` here.
    """
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
        "decode_responses": decode,
    }
    if decode:  # text a job wrote is never trusted to be UTF-8: one bad byte fails no read
        options["encoding_errors"] = "replace"
    secure = url.startswith(("rediss://", "rediss+sentinel://"))
    if secure:
        options.update((tls or Tls()).options())
    elif tls is not None and tls != Tls():
        raise RedisUnavailableError(
            f"TLS files are configured but {_redact(url)!r} is not a rediss:// URL"
        )
    if cluster and redis_url.is_sentinel(url):
        raise RedisUnavailableError("redis.cluster and a Sentinel URL exclude each other")
    try:
        if redis_url.is_sentinel(url):
            return master_client(redis_url.parse_sentinel(url), options)
        if cluster:
            return RedisCluster.from_url(url, **options)
        return redis.Redis.from_url(url, health_check_interval=30, **options)
    except (ValueError, redis.RedisError) as exc:
        raise RedisUnavailableError(f"bad Redis URL {_redact(url)!r}: {exc}") from exc


def connect_from(
    settings: Settings,
    *,
    retries: int = 1,
    decode: bool = False,
    timeout_s: float | None = None,
) -> RedisClient:
    """A client configured by ``settings``: URL, cluster mode, TLS material, timeout."""
    return connect(
        settings.redis.url,
        timeout_s=settings.redis.timeout_s if timeout_s is None else timeout_s,
        cluster=settings.redis.cluster,
        retries=retries,
        decode=decode,
        tls=tls_from(settings),
    )


def tls_from(settings: Settings) -> Tls:
    """The TLS material named by ``settings``."""
    return Tls(
        settings.redis.tls_ca_file, settings.redis.tls_cert_file, settings.redis.tls_key_file
    )


def ping(url: str, timeout_s: float = 1.0, tls: Tls | None = None) -> bool:
    """True when the Redis at ``url`` answers a PING right now (no retries)."""
    client = connect(url, timeout_s=timeout_s, retries=0, tls=tls)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _redact(url: str) -> str:
    """The URL without its password, for messages."""
    from slurm_plugin.config import redact_url  # noqa: PLC0415 - config imports are heavy

    return redact_url(url)


def _fields(fields: Mapping[str, str]) -> dict[Any, Any]:
    """Stream fields in the loose type redis-py's stubs ask for."""
    return dict(fields)


@dataclass(frozen=True)
class EntriesPage:
    """A chunk of a job's steps stream: its entries' fields, not decoded yet."""

    entries: list[Mapping[str, str]]
    last_id: str
    #: Stream entries read (repeats included).
    read: int
    #: Entries skipped as repeats of one already read (a retried write stored twice).
    repeats: int
    #: Flushes a reporter numbered but the stream never had, between two it has: acknowledged
    #: by a Redis master that died before its replica had them (a Sentinel failover), or
    #: dropped whole by a reporter whose buffer overflowed while Redis was away.
    missing: int = 0


@dataclass(frozen=True)
class StepsPage:
    """A chunk of a job's steps stream, decoded; malformed entries are counted, not raised."""

    records: list[StepRecord]
    last_id: str
    malformed: int
    #: Stream entries read (each one rank's flush of several steps, or a node relay's entry
    #: packing several ranks' flushes).
    entries: int = 0
    #: Rank flushes skipped as repeats of one already read (a retried flush stored twice).
    repeats: int = 0


#: Per (rank, reporter session): the highest flush sequence read. A reporter's entries reach
#: the stream in sequence order, so an entry at or below it is a repeat.
Seen = dict[tuple[str, str], int]


@dataclass(frozen=True)
class StreamMark:
    """Where a job's steps stream stands: its newest entry id and how many entries it has
    ever had (trimmed ones included)."""

    last_id: str
    added: int


class TelemetryStore:
    """Reads and writes a job's telemetry keys."""

    def __init__(self, client: RedisClient, *, steps_maxlen: int = keys.STEPS_MAXLEN) -> None:
        self.client = client
        self.steps_maxlen = steps_maxlen

    # -- writing ---------------------------------------------------------------------------
    def publish(
        self,
        job_id: str,
        steps: Sequence[Mapping[str, str]] = (),
        events: Sequence[Mapping[str, Any]] = (),
        gpu_samples: Sequence[Mapping[str, Any]] = (),
        *,
        refresh_ttl: bool = False,
        steps_maxlen: int | None = None,
    ) -> int:
        """Append encoded step batches, events and GPU samples of one job in one round trip;
        the number of events and samples refused (a NaN, an unencodable value: logged, never
        stored, never worth sending again, and never the reason the steps are lost)."""
        maxlen = steps_maxlen or self.steps_maxlen
        pipe = self.client.pipeline(transaction=False)
        for fields in steps:
            pipe.xadd(keys.job_steps(job_id), _fields(fields), maxlen=maxlen, approximate=True)
        refused = 0
        for key, entries, cap in (
            (keys.job_events(job_id), events, keys.EVENTS_MAXLEN),
            (keys.job_gpu(job_id), gpu_samples, keys.GPU_MAXLEN),
        ):
            for entry in entries:
                try:
                    encoded = encode_json_entry(entry)
                except TelemetryError as exc:
                    refused += 1
                    log.warning("telemetry.record_refused", job_id=job_id, error=str(exc))
                    continue
                pipe.xadd(key, _fields(encoded), maxlen=cap, approximate=True)
        if refresh_ttl:
            for key in keys.job_streams(job_id):
                pipe.expire(key, keys.JOB_TTL_ACTIVE_S)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            raise RedisUnavailableError(f"publish for job {job_id} failed: {exc}") from exc
        return refused

    def expire_job(self, job_id: str, ttl_s: int = keys.JOB_TTL_FINISHED_S) -> None:
        """Give every key of a finished job a TTL so Redis never grows without bound."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys.job_keys(job_id):
            pipe.expire(key, ttl_s)
        pipe.execute()

    # -- reading ---------------------------------------------------------------------------
    def steps_mark(self, job_id: str) -> StreamMark | None:
        """The steps stream's newest id and entries ever added; None when it does not exist
        yet or the server does not say (Redis before 7.0)."""
        return self.stream_mark(keys.job_steps(job_id))

    def stream_mark(self, key: str) -> StreamMark | None:
        """A stream's newest id and entries ever added (:meth:`steps_mark`, any stream)."""
        try:
            info = cast("dict[Any, Any]", self.client.xinfo_stream(key))
        except redis.ResponseError:  # no such key
            return None
        return mark_of(info)

    def read_entries(
        self,
        job_id: str,
        after: str = "0-0",
        count: int = 5000,
        until: str = "+",
        seen: Seen | None = None,
    ) -> EntriesPage:
        """The steps entries after stream id ``after`` (exclusive) up to ``until`` (inclusive),
        not decoded; with ``seen`` (kept by the caller across pages), repeats of entries
        already read are skipped and counted."""
        raw = cast(
            "list[tuple[bytes, dict[bytes, bytes]]]",
            self.client.xrange(keys.job_steps(job_id), min=f"({after}", max=until, count=count),
        )
        return entries_page(raw, after, seen=seen)

    def read_steps(
        self,
        job_id: str,
        after: str = "0-0",
        count: int = 5000,
        until: str = "+",
        seen: Seen | None = None,
    ) -> StepsPage:
        """:meth:`read_entries`, decoded into records (export, backtest)."""
        page = self.read_entries(job_id, after, count, until, seen)
        decoded = decode_entries(page.entries)
        for error in decoded.errors:
            log.warning("telemetry.malformed_entry", job_id=job_id, until=page.last_id, error=error)
        records = decoded.batch.to_records(job_id)
        return StepsPage(records, page.last_id, decoded.malformed, page.read, page.repeats)

    def latest_steps(self, job_id: str, entries: int = 5000) -> list[StepRecord]:
        """The records of the newest ``entries`` stream entries, for a bounded look at what
        the job does now; malformed entries are skipped."""
        newest = cast(
            "list[tuple[bytes, dict[bytes, bytes]]]",
            self.client.xrevrange(keys.job_steps(job_id), count=entries),
        )
        decoded = decode_entries([to_text(raw) for _, raw in reversed(newest)])  # type: ignore[arg-type]
        return decoded.batch.to_records(job_id)

    def iter_steps(self, job_id: str, chunk: int = 5000) -> Iterator[StepRecord]:
        """Every step record of the job, oldest entry first."""
        after = "0-0"
        seen: Seen = {}
        while True:
            page = self.read_steps(job_id, after, chunk, seen=seen)
            yield from page.records
            if page.last_id == after:
                return
            after = page.last_id

    def read_events(
        self, job_id: str, after: str = "0-0", count: int = 1000
    ) -> tuple[list[dict[str, Any]], str, int]:
        """The job's events after stream id ``after``, the id to continue from, and how many
        were malformed (skipped: a NaN written by a client of its own, a broken entry)."""
        entries = cast(
            "list[tuple[bytes, dict[bytes, bytes]]]",
            self.client.xrange(keys.job_events(job_id), min=f"({after}", count=count),
        )
        return events_of(job_id, entries, after)

    def iter_events(self, job_id: str) -> Iterator[tuple[float, str]]:
        """The job's events as (time, name), oldest first, page by page; an event without a
        finite time or a name is skipped."""
        after = "0-0"
        while True:
            page, cursor, _malformed = self.read_events(job_id, after, count=1000)
            if cursor == after:  # a page of malformed events only still moves on
                return
            after = cursor
            for event in page:
                ts, name = event.get("ts"), event.get("name")
                if isinstance(ts, int | float) and math.isfinite(ts) and isinstance(name, str):
                    yield float(ts), name

    def read_json(self, key: str, count: int = 1000) -> list[dict[str, Any]]:
        """The newest ``count`` JSON entries of an events or GPU stream, oldest first."""
        entries = cast(
            "list[tuple[bytes, dict[bytes, bytes]]]", self.client.xrevrange(key, count=count)
        )
        out = []
        for _entry_id, fields in reversed(entries):
            try:
                out.append(decode_json_entry(to_text(fields)))  # type: ignore[arg-type]
            except TelemetryError:
                log.warning("telemetry.malformed_entry", key=key)
        return out


#: An XRANGE answer: bytes from a plain client, text from one that decodes.
Raw = list[tuple[Any, dict[Any, Any]]]


def mark_of(info: Mapping[Any, Any]) -> StreamMark | None:
    """The mark in an ``XINFO STREAM`` answer; None when the server does not say."""
    added = info.get("entries-added", info.get(b"entries-added"))
    last = info.get("last-generated-id", info.get(b"last-generated-id"))
    if added is None or last is None:
        return None
    return StreamMark(last.decode() if isinstance(last, bytes) else str(last), int(added))


def _stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _fields_text(values: Mapping[Any, Any]) -> dict[str, str]:
    """An entry's fields as text: as they are from a client that decodes (the service's)."""
    first = next(iter(values), None)
    if isinstance(first, str):  # read only: a decoding client's own dict is not copied
        return values if isinstance(values, dict) else dict(values)
    return to_text(values)


def entries_page(raw: Raw, after: str, until: str = "+", seen: Seen | None = None) -> EntriesPage:
    """The steps entries of an ``XRANGE`` answer, not decoded, up to ``until`` (inclusive:
    later ones stay unread); with ``seen`` (kept by the caller across pages), repeats of
    entries already read are skipped and counted, and the flushes missing between two read
    (never stored, or lost in a failover) counted."""
    if until != "+" and raw and _stream_id(_text(raw[-1][0])) > _stream_id(until):
        bound = _stream_id(until)
        raw = [entry for entry in raw if _stream_id(_text(entry[0])) <= bound]
    entries: list[Mapping[str, str]] = []
    repeats = missing = 0
    last = after
    # A decoding client's answer (the service's) is text and dicts throughout: taken as it is.
    text = bool(raw) and isinstance(raw[0][0], str) and isinstance(raw[0][1], dict)
    for entry_id, values in raw:
        if text:
            last, fields = entry_id, values
        else:
            last, fields = _text(entry_id), _fields_text(values)
        flush = flush_id(fields) if seen is not None else None
        if seen is not None and flush is not None:
            # A rank's flushes by rank; a relay's entries by its node (never digits alone).
            who = f"@{fields.get('node', '')}" if is_relayed(fields) else fields.get("rank", "")
            before = seen.get((who, flush[0]), -1)
            if flush[1] <= before:
                repeats += 1
                continue
            if before >= 0:  # the first flush read of a session sets where it starts
                missing += flush[1] - before - 1
            seen[(who, flush[0])] = flush[1]
        entries.append(fields)
    return EntriesPage(entries, last, len(raw), repeats, missing)


def events_of(job_id: str, raw: Raw, after: str) -> tuple[list[dict[str, Any]], str, int]:
    """The events of an ``XRANGE`` answer, the id to continue from, and how many were
    malformed (skipped: a NaN written by a client of its own, a broken entry)."""
    events = []
    malformed = 0
    for entry_id, fields in raw:
        after = _text(entry_id)
        try:
            events.append(decode_json_entry(_fields_text(fields)))
        except TelemetryError as exc:
            malformed += 1
            log.warning("telemetry.malformed_entry", job_id=job_id, entry=after, error=str(exc))
    return events, after, malformed
