"""Who a node relay serves: the kernel's word on each connecting process, and the bounds that
keep one user (or one job) from taking every connection of the node.

The relay runs one thread per connection, so it bounds them; a bound shared by everyone is a
way to blind the node (a process that holds every slot leaves every job's ranks refused).
The bounds are therefore per peer: a process that runs in no job is turned away at once (it
could never publish), one job's processes hold at most ``MAX_PER_JOB`` connections and one
user's (root aside) ``MAX_PER_USER``, with ``MAX_CONNECTIONS`` in all. A connection turned
away costs its rank nothing: its reporter publishes to Redis itself (``telemetry.outlet``).
"""

from __future__ import annotations

import contextlib
import pwd
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

#: Connections served at once, in all (one thread each).
MAX_CONNECTIONS = 1024
#: Connections of one job's processes (a node runs a few ranks per GPU at most; more ranks of
#: a job publish to Redis themselves).
MAX_PER_JOB = 128
#: Connections of one user's processes, all their jobs together (root's are not bounded so).
MAX_PER_USER = 256
#: How often a relay logs the connections it turned away (with how many since).
_LOG_EVERY_S = 60.0
_CGROUP_JOB = re.compile(r"/job_([0-9]+)(?:/|$)")


def job_of_process(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The Slurm job a process runs in: its cgroup's ``job_N`` (Slurm's cgroup plugin; the
    process cannot leave it), else its ``SLURM_JOB_ID``; None when it shows neither."""
    with contextlib.suppress(OSError):
        for line in (proc / str(pid) / "cgroup").read_text().splitlines():
            match = _CGROUP_JOB.search(line)
            if match:
                return match[1]
    with contextlib.suppress(OSError):
        for item in (proc / str(pid) / "environ").read_bytes().split(b"\0"):
            if item.startswith(b"SLURM_JOB_ID="):
                return item.split(b"=", 1)[1].decode(errors="replace") or None
    return None


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """The process id and user id of a Unix socket's peer, as the kernel recorded them at
    connect time."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def user_name(uid: int) -> str | None:
    """The name of a user id (None: no such user)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


@dataclass(frozen=True)
class Peer:
    """A connected process, as the kernel describes it."""

    pid: int
    uid: int
    #: The job it runs in (``job_of_process``); a connection of no job is never admitted.
    job: str


class Admission:
    """The connections a relay serves now, counted per job and per user; thread-safe."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._peers: dict[int, Peer] = {}  # by id() of the connection's socket
        self._jobs: Counter[tuple[int, str]] = Counter()
        self._users: Counter[int] = Counter()
        #: Connections turned away, by why (for logs and tests).
        self.turned_away: Counter[str] = Counter()
        self._logged = -float("inf")
        self._unlogged = 0

    @property
    def served(self) -> int:
        with self._lock:
            return len(self._peers)

    def admit(self, conn: socket.socket, job_of: Callable[[int], str | None]) -> Peer | None:
        """The peer of ``conn`` when the relay serves it (counted until :meth:`release`),
        else None (the caller closes the connection)."""
        try:
            pid, uid = peer_credentials(conn)
            job = job_of(pid)
        except OSError:
            self._turn_away("credentials", "no peer credentials", -1, None)
            return None
        if not job:
            self._turn_away("no job", "the process runs in no job", uid, None)
            return None
        with self._lock:
            over = self._over(uid, job)
            if over is None:
                peer = Peer(pid, uid, job)
                self._peers[id(conn)] = peer
                self._jobs[(uid, job)] += 1
                self._users[uid] += 1
                return peer
        self._turn_away(*over, uid, job)
        return None

    def peer(self, conn: socket.socket) -> Peer | None:
        """The admitted peer of ``conn`` (None once released, or never admitted)."""
        with self._lock:
            return self._peers.get(id(conn))

    def release(self, conn: socket.socket) -> None:
        """Forget ``conn`` (admitted or not; call it once its conversation is over)."""
        with self._lock:
            peer = self._peers.pop(id(conn), None)
            if peer is None:
                return
            self._jobs[(peer.uid, peer.job)] -= 1
            if self._jobs[(peer.uid, peer.job)] <= 0:
                del self._jobs[(peer.uid, peer.job)]
            self._users[peer.uid] -= 1
            if self._users[peer.uid] <= 0:
                del self._users[peer.uid]

    def _over(self, uid: int, job: str) -> tuple[str, str] | None:
        """Which bound a new connection of ``(uid, job)`` would pass: (kind, why)."""
        if len(self._peers) >= MAX_CONNECTIONS:
            return "relay", f"the relay serves {MAX_CONNECTIONS} connections"
        if self._jobs[(uid, job)] >= MAX_PER_JOB:
            return "job", f"job {job} holds {MAX_PER_JOB} connections"
        if uid != 0 and self._users[uid] >= MAX_PER_USER:
            return "user", f"user {uid} holds {MAX_PER_USER} connections"
        return None

    def _turn_away(self, kind: str, why: str, uid: int, job: str | None) -> None:
        with self._lock:
            self.turned_away[kind] += 1
            self._unlogged += 1
            now = time.monotonic()
            if now - self._logged < _LOG_EVERY_S:
                return
            count, self._unlogged, self._logged = self._unlogged, 0, now
        log.warning(
            "relay.connection_turned_away",
            node=self.node,
            why=why,
            uid=uid,
            peer_job=job,
            turned_away=count,
            hint="its reporter publishes to Redis itself",
        )
