"""The node relay: one Redis connection per node instead of one per rank.

A root-owned process on each node (``straggler relay``) listens on a Unix socket. A rank's
reporter sends its flushes there (one JSON line per flush: the job, the encoded steps entries,
the events); every ``tick_s`` (a second, the reporters' flush interval) the relay writes one
steps entry per job holding every flush it received (``model.relayed``), in
one pipeline, then answers each flush. Redis sees one client per node, and the service one
stream entry per node and tick.

What a rank can claim is bounded by what the kernel says of it: the relay reads the sending
process's id and user from the socket (``SO_PEERCRED``) and refuses a flush for any job but the
one that process runs in (Slurm's cgroup ``job_N``, else its ``SLURM_JOB_ID``), and, root's
processes aside, from any user but the job's (as the prolog registered it: a process can set
``SLURM_JOB_ID`` to any job where Slurm's cgroup plugin is absent); the node of every flush is
the relay's own. A reporter that cannot reach a relay, or is refused, publishes to Redis
itself (with its own job's credential).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import secrets
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import structlog

from slurm_plugin.errors import RedisUnavailableError, StragglerError, TelemetryError
from slurm_plugin.model import keys
from slurm_plugin.model.records import FlushHeader, check_steps, encode_json_entry, flush_id
from slurm_plugin.model.relayed import encode_relayed
from slurm_plugin.store import registration
from slurm_plugin.store.telemetry_store import TelemetryStore
from slurm_plugin.telemetry.relay_peers import Admission, Peer, job_of_process, user_name

log = structlog.get_logger(__name__)

DEFAULT_SOCKET = Path("/run/slurm-straggler/relay.sock")
#: The largest flush message a relay reads (a reporter's flush is at most a few hundred kB).
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
#: How long a flush waits for the tick that stores it; a reporter waits longer for the answer.
ANSWER_WAIT_S = 10.0
_STORED_KEEP_S = 600.0
#: How long a job's registered user is remembered (it never changes while the job lives).
_OWNER_KEEP_S = 60.0


@dataclass
class _Flush:
    job_id: str
    #: The reporter's steps entries, checked (the relay never packs one that readers refuse).
    steps: list[FlushHeader]
    #: Each steps entry's reporter id (session, sequence), when it has one.
    ids: list[tuple[str, int] | None]
    events: list[dict[str, Any]]
    refresh_ttl: bool
    steps_maxlen: int | None
    #: Events refused when read (not plain finite JSON): counted, answered, never stored.
    invalid_events: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    #: The relay cannot publish this flush (not Redis being away): the rank goes to Redis.
    refused: bool = False


def parse_message(line: bytes) -> _Flush:
    """A flush message; :class:`TelemetryError` when it is not one."""
    try:
        message = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TelemetryError(f"not a JSON flush message: {exc}") from None
    except RecursionError:  # "[[[[..." 100,000 deep: killed the connection, uncounted
        raise TelemetryError("not a flush message: JSON nested too deep") from None
    if not isinstance(message, dict):
        raise TelemetryError("a flush message is a JSON object")
    steps = message.get("steps", [])
    events = message.get("events", [])
    maxlen = message.get("steps_maxlen")
    if not (
        isinstance(steps, list)
        and all(isinstance(s, dict) and all(isinstance(v, str) for v in s.values()) for s in steps)
        and isinstance(events, list)
        and all(isinstance(e, dict) for e in events)
        and (maxlen is None or (isinstance(maxlen, int) and maxlen > 0))
    ):
        raise TelemetryError("a flush message holds steps entries, events and steps_maxlen")
    job_id = keys.check_job_id(str(message.get("job_id", "")))
    good = [e for e in events if _storable(e)]
    return _Flush(
        job_id,
        [check_steps(fields) for fields in steps],  # every value checked; raises on a bad one
        [flush_id(fields) for fields in steps],
        good,
        bool(message.get("refresh_ttl")),
        maxlen,
        invalid_events=len(events) - len(good),
    )


def _storable(event: dict[str, Any]) -> bool:
    """An event Redis can take as it is (a NaN one would fail the tick of every job here)."""
    try:
        encode_json_entry(event)
    except TelemetryError:
        return False
    return True


class Relay:
    """Serves one node's ranks on ``socket_path`` and publishes for them through ``store``."""

    def __init__(
        self,
        store: TelemetryStore,
        node: str,
        socket_path: Path = DEFAULT_SOCKET,
        *,
        tick_s: float = 1.0,
        job_of: Callable[[int], str | None] = job_of_process,
        owner_of: Callable[[str], str | None] | None = None,
        name_of: Callable[[int], str | None] = user_name,
    ) -> None:
        self.store = store
        self.node = keys.check_node(node)
        self.socket_path = socket_path
        self.tick_s = tick_s
        self._job_of = job_of
        self._owner_of = owner_of or self._registered_user
        self._name_of = name_of
        self._owners: dict[str, tuple[str | None, float]] = {}
        self._queue: list[_Flush] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        #: Who is connected, and the bounds per job and per user (``relay_peers``).
        self.admission = Admission(self.node)
        # Per (rank, reporter session): the newest flush stored. A reporter that did not hear
        # our answer sends a flush again; one already stored is not packed twice.
        # Kept 10 minutes after the last one (a reporter retries within seconds).
        self._stored: dict[tuple[int, str], tuple[int, float]] = {}
        # This relay's own entry ids (a write Redis stored before we gave up is read once).
        self._session = secrets.token_hex(8)
        self._seq = 0
        # Counters, for logs and tests.
        self.flushes = 0
        self.entries = 0
        self.refused = 0
        self.repeats = 0
        self.invalid_events = 0

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Listen (any local user may connect: the kernel tells us who they are) and serve in
        background threads."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self._server = _Server(self)
        self.socket_path.chmod(0o666)
        accept = functools.partial(self._server.serve_forever, poll_interval=0.5)
        for target, name in ((accept, "accept"), (self._publish_loop, "publish")):
            thread = threading.Thread(target=target, name=f"straggler-relay-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("relay.listening", node=self.node, socket=str(self.socket_path))

    def close(self) -> None:
        """Stop serving; flushes still queued are answered with an error (their reporters
        send them again, to Redis itself if no relay answers). Closes the store's
        connection: the relay owns it."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()  # the accept loop returns; no connection is taken after
        for thread in self._threads:
            thread.join(5.0)
        if self._server is not None:
            self._server.server_close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:  # a reporter waiting on us hears it now, not after its timeout
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self._answer(self._take(), "relay stopped")
        with contextlib.suppress(Exception):  # the relay owns its store's connection
            self.store.client.close()

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (a signal handler may call it)."""
        self._stop.set()

    def serve_forever(self) -> None:
        """Serve (starting first if :meth:`start` was not called) until :meth:`stop`, then
        close."""
        if self._server is None:
            self.start()
        try:
            while not self._stop.wait(1.0):
                pass
        finally:
            self.close()

    # -- connections -------------------------------------------------------------------------
    @property
    def connections(self) -> int:
        """Reporters connected now."""
        with self._lock:
            return len(self._conns)

    def _serve(self, conn: socket.socket, reader: Any, peer: Peer) -> None:
        """One reporter's connection, in its own thread (``_Server``)."""
        with self._lock:
            self._conns.add(conn)
        try:
            self._converse(conn, reader, peer.job, peer.uid)
        finally:
            with self._lock:
                self._conns.discard(conn)

    def _converse(self, conn: socket.socket, reader: Any, job: str, uid: int) -> None:
        """Answer one reporter's flushes until it hangs up (or we stop)."""
        while not self._stop.is_set():
            try:
                line = reader.readline(MAX_MESSAGE_BYTES + 1)
            except OSError:
                return
            if not line or self._stop.is_set():
                return
            reply = self._handle(line, job, uid)
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                return

    def _handle(self, line: bytes, peer_job: str | None, uid: int) -> dict[str, Any]:
        if len(line) > MAX_MESSAGE_BYTES:
            return self._refuse(f"message over {MAX_MESSAGE_BYTES} bytes", peer_job)
        try:
            flush = parse_message(line)
        except StragglerError as exc:
            return self._refuse(str(exc), peer_job)
        if flush.job_id != peer_job:
            return self._refuse(
                f"this process runs in job {peer_job or 'none'}, not {flush.job_id}", peer_job
            )
        not_its_user = self._not_its_user(flush.job_id, uid)
        if not_its_user is not None:
            return self._refuse(not_its_user, peer_job)
        if flush.invalid_events:
            self.invalid_events += flush.invalid_events
            log.warning(
                "relay.invalid_events",
                node=self.node,
                job_id=flush.job_id,
                refused=flush.invalid_events,
                refused_total=self.invalid_events,
            )
        with self._lock:
            self._queue.append(flush)
        # Answered after the tick that stores it (or the relay's stop).
        if not flush.done.wait(self.tick_s + ANSWER_WAIT_S):
            return {"ok": False, "error": "relay busy: flush not stored in time"}
        return _reply(flush)

    def _not_its_user(self, job_id: str, uid: int) -> str | None:
        """Why a process of ``uid`` may not publish for ``job_id`` (None: it may): root's may;
        any other user's only when it is the user the job was registered with."""
        if uid == 0:
            return None
        now = time.monotonic()
        owner, at = self._owners.get(job_id, (None, -math.inf))
        if now - at > _OWNER_KEEP_S:
            try:
                owner = self._owner_of(job_id)
            except (StragglerError, OSError) as exc:
                return f"cannot tell who runs job {job_id}: {exc}"
            if owner:
                self._owners[job_id] = (owner, now)
        name = self._name_of(uid) if uid >= 0 else None
        if owner and name == owner:
            return None
        return (
            f"a process of {name or f'uid {uid}'} may not publish for job {job_id} "
            f"(its user: {owner or 'unknown, no registration of the job'})"
        )

    def _registered_user(self, job_id: str) -> str | None:
        """The job's user as its prolog registered it (None: not registered)."""
        try:
            user = registration.read(self.store.client, job_id).user
        except redis.RedisError as exc:
            raise RedisUnavailableError(f"registration of job {job_id}: {exc}") from exc
        return user or None

    def _refuse(self, why: str, peer_job: str | None) -> dict[str, Any]:
        self.refused += 1
        log.warning("relay.refused", node=self.node, peer_job=peer_job, error=why)
        return {"ok": False, "refused": True, "error": why}

    # -- publishing -------------------------------------------------------------------------
    def _take(self) -> list[_Flush]:
        with self._lock:
            taken, self._queue = self._queue, []
        return taken

    def _publish_loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            taken = self._take()
            if not taken:
                continue
            try:
                error = self.publish(taken)
            except Exception as exc:  # never the end of every job's telemetry on this node
                log.exception("relay.publish_crashed", node=self.node)
                for flush in taken:
                    if not flush.done.is_set():
                        flush.error, flush.refused = f"relay cannot publish: {exc}", True
                error = None
            self._answer(taken, error)

    def publish(self, flushes: Sequence[_Flush]) -> str | None:
        """One steps entry per job for ``flushes``, with their events, in one pipeline per
        job; the error text when Redis did not take them."""
        by_job: dict[str, list[_Flush]] = {}
        for flush in flushes:
            by_job.setdefault(flush.job_id, []).append(flush)
        error = None
        for job_id, group in by_job.items():
            fresh = [
                (head, fid)
                for f in group
                for head, fid in zip(f.steps, f.ids, strict=True)
                if not self._repeat(head, fid)
            ]
            steps = [head for head, _ in fresh]
            # The reporters' cap is in rank flushes (world size x seconds); our entries each
            # hold this node's ranks, so the same seconds of data take that many times fewer.
            ranks_here = max(1, len({head.rank for head in steps}))
            maxlens = [max(1000, f.steps_maxlen // ranks_here) for f in group if f.steps_maxlen]
            self._seq += 1
            try:
                self.invalid_events += self.store.publish(
                    job_id,
                    [encode_relayed(self.node, steps, f"{self._session}.{self._seq}")]
                    if steps
                    else [],
                    [e for f in group for e in f.events],
                    refresh_ttl=any(f.refresh_ttl for f in group),
                    steps_maxlen=max(maxlens) if maxlens else None,
                )
            except RedisUnavailableError as exc:
                error = str(exc)
                for flush in group:
                    flush.error = error
                continue
            except Exception as exc:  # this job's flushes alone; the other jobs' go on
                log.exception("relay.publish_crashed", node=self.node, job_id=job_id)
                for flush in group:
                    flush.error, flush.refused = f"relay cannot publish: {exc}", True
                continue
            now = time.monotonic()
            for head, fid in fresh:
                if fid is not None:
                    key = (head.rank, fid[0])
                    self._stored[key] = (max(fid[1], self._stored.get(key, (-1, 0.0))[0]), now)
            if len(self._stored) > 4096:
                old = [k for k, (_, at) in self._stored.items() if now - at > _STORED_KEEP_S]
                for key in old:
                    del self._stored[key]
            self.flushes += len(group)
            self.entries += 1 if steps else 0
        return error

    def _repeat(self, head: FlushHeader, fid: tuple[str, int] | None) -> bool:
        """A flush already stored (its reporter sends it again when it missed our answer)."""
        if fid is None or fid[1] > self._stored.get((head.rank, fid[0]), (-1, 0.0))[0]:
            return False
        self.repeats += 1
        return True

    @staticmethod
    def _answer(flushes: Sequence[_Flush], error: str | None) -> None:
        for flush in flushes:
            if error is not None and flush.error is None:
                flush.error = error
            flush.done.set()


class _Handler(socketserver.StreamRequestHandler):
    """Hands one accepted connection to its relay."""

    server: _Server

    def handle(self) -> None:
        peer = self.server.relay.admission.peer(self.request)
        if peer is not None:
            self.server.relay._serve(self.request, self.rfile, peer)


class _Server(socketserver.ThreadingUnixStreamServer):
    """The standard library's threaded Unix-socket server, with bounds on the connections
    served at once (``relay_peers.Admission``): a connection over them is closed at once, and
    its reporter publishes to Redis itself. The slot is taken in the accepting thread before
    the connection's thread starts, so a burst of connections can never exceed a bound."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        super().__init__(str(relay.socket_path), _Handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.relay.admission.admit(request, self.relay._job_of) is not None

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.relay.admission.release(request)


def _reply(flush: _Flush) -> dict[str, Any]:
    """The answer to a flush the publisher is done with."""
    if flush.refused:
        return {"ok": False, "refused": True, "error": flush.error}
    if flush.error is not None:
        return {"ok": False, "error": flush.error}
    return {"ok": True, "invalid_events": flush.invalid_events}
