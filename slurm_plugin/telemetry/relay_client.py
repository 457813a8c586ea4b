"""A reporter's side of the node relay (``telemetry.relay``): one connection, one JSON line
per flush, answered once the relay has stored it. Kept apart from the relay's server so that a
rank imports only this."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slurm_plugin.errors import RedisUnavailableError, TelemetryError

#: How long a reporter waits for the relay's answer (the relay stores within a tick or two).
CLIENT_TIMEOUT_S = 15.0


class RelayRefusedError(TelemetryError):
    """The relay will not publish for this process (another job's flush, a bad message)."""


class RelayTurnedAwayError(RedisUnavailableError):
    """The relay closed a new connection before answering anything on it: over its bounds
    (``relay_peers``), it never read the flush. The reporter publishes to Redis itself."""


class RelayClient:
    """A reporter's way to its node's relay: :meth:`publish` as :class:`TelemetryStore`'s,
    answered once the relay has stored the flush. Any trouble raises
    :class:`RedisUnavailableError` (the reporter keeps the flush and tries again)."""

    def __init__(self, socket_path: Path, timeout_s: float = CLIENT_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._conn: socket.socket | None = None
        self._reader: Any = None
        #: Answers read on the current connection (none yet: a close is the relay's refusal).
        self.answered = 0

    @classmethod
    def connect(cls, socket_path: Path, timeout_s: float = CLIENT_TIMEOUT_S) -> RelayClient:
        """A client connected to the relay now; :class:`OSError` when none listens."""
        client = cls(socket_path, timeout_s)
        client._open()
        return client

    def _open(self) -> None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(self.timeout_s)
        try:
            conn.connect(str(self.socket_path))
        except OSError:
            conn.close()
            raise
        self._conn, self._reader = conn, conn.makefile("rb")
        self.answered = 0

    def publish(
        self,
        job_id: str,
        steps: Sequence[Mapping[str, str]] = (),
        events: Sequence[Mapping[str, Any]] = (),
        *,
        refresh_ttl: bool = False,
        steps_maxlen: int | None = None,
    ) -> int:
        """Send one flush and wait for the relay's answer; the events it refused (they are
        gone: sending them again would be refused again)."""
        message = {
            "job_id": job_id,
            "steps": list(steps),
            "events": list(events),
            "refresh_ttl": refresh_ttl,
            "steps_maxlen": steps_maxlen,
        }
        started = time.monotonic()
        try:
            if self._conn is None:
                self._open()
            assert self._conn is not None  # noqa: S101 - _open sets it or raises
            self._conn.sendall(json.dumps(message, default=str, allow_nan=False).encode() + b"\n")
            line = self._reader.readline(65536)
        except (BrokenPipeError, ConnectionResetError) as exc:
            self.close()
            raise self._closed(str(exc)) from exc
        except OSError as exc:
            self.close()
            raise RedisUnavailableError(f"relay {self.socket_path}: {exc}") from exc
        if not line:
            self.close()
            raise self._closed("closed the connection")
        self.answered += 1
        try:
            reply = json.loads(line)
        except ValueError:
            reply = {"ok": False, "error": "unreadable reply"}
        if reply.get("refused"):
            raise RelayRefusedError(f"relay {self.socket_path} refused: {reply.get('error', '?')}")
        if not reply.get("ok"):
            raise RedisUnavailableError(
                f"relay {self.socket_path} did not store the flush "
                f"({reply.get('error', '?')}, after {time.monotonic() - started:.1f} s)"
            )
        refused = reply.get("invalid_events", 0)
        return refused if isinstance(refused, int) and refused >= 0 else 0

    def _closed(self, how: str) -> RedisUnavailableError:
        """The error for a connection the relay closed: before any answer on it, the relay
        turned it away (it closes at once and reads nothing: nothing was stored)."""
        if self.answered == 0:
            return RelayTurnedAwayError(f"relay {self.socket_path} turned the connection away")
        return RedisUnavailableError(f"relay {self.socket_path}: {how}")

    def close(self) -> None:
        if self._reader is not None:
            with contextlib.suppress(OSError):
                self._reader.close()
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
        self._conn = self._reader = None


__all__ = ["CLIENT_TIMEOUT_S", "RelayClient", "RelayRefusedError"]
