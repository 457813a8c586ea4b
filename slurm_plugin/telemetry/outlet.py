"""Where a rank's flushes go: the node relay while one answers, else Redis itself.

A relay that refuses the process (a flush for a job that is not its own) is not asked again;
a rank that publishes to Redis itself because no relay answered, or the relay turned its
connection away (over its bounds per job and per user), tries the relay again every
``retry_s``, so a relay started (or restarted, or less busy) after the job still takes its
ranks over, and the job's Redis connections fall back to one per node.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from slurm_plugin.store.telemetry_store import TelemetryStore
from slurm_plugin.telemetry.relay_client import (
    RelayClient,
    RelayRefusedError,
    RelayTurnedAwayError,
)

log = structlog.get_logger(__name__)

RELAY_RETRY_S = 30.0

Destination = TelemetryStore | RelayClient


class Outlet:
    """Chooses, and changes, where one reporter publishes."""

    def __init__(
        self,
        store_factory: Callable[[], TelemetryStore],
        relay_socket: Path | None,
        *,
        job_id: str,
        rank: int,
        retry_s: float | None = None,
    ) -> None:
        self._store_factory = store_factory
        self._relay_socket = relay_socket
        self._job_id = job_id
        self._rank = rank
        self.retry_s = RELAY_RETRY_S if retry_s is None else retry_s
        self.refused = False
        #: Times the relay turned a connection of ours away (for logs and tests).
        self.turned_away = 0
        self._relay_tried = -float("inf")
        self._turned_away_at = -float("inf")

    def connect(self) -> Destination:
        """The relay when one answers (and has not refused us), else Redis itself; raises
        what the store factory raises."""
        relay = self._relay()
        if relay is not None:
            return relay
        return self._store_factory()

    def reconsider(self, current: Destination) -> Destination:
        """``current``, or the relay when we publish to Redis ourselves, the retry period has
        passed and a relay answers now (the direct connection is then closed). Call it only
        between flushes that succeeded: a flush Redis may have stored is never sent again
        through the relay, which would store it under another id."""
        if isinstance(current, RelayClient):
            return current
        if time.monotonic() - self._relay_tried < self.retry_s:
            return current
        relay = self._relay()
        if relay is None:
            return current
        self.close(current)
        log.info("telemetry.relay_found", job_id=self._job_id, rank=self._rank)
        return relay

    def failed(self, current: Destination | None, exc: Exception) -> Destination | None:
        """What to keep after a failed publish: a relay connection is dropped (next time:
        the relay again if it is back, else Redis); a relay that refused us is not asked
        again, one that turned our connection away not for ``retry_s``."""
        if isinstance(exc, RelayRefusedError) and not self.refused:
            self.refused = True
            log.warning(
                "telemetry.relay_refused", job_id=self._job_id, rank=self._rank, error=str(exc)
            )
        if isinstance(exc, RelayTurnedAwayError):
            if self.turned_away == 0:
                log.warning(
                    "telemetry.relay_turned_away",
                    job_id=self._job_id,
                    rank=self._rank,
                    hint="the relay is at its bound; this rank publishes to Redis itself",
                )
            self.turned_away += 1
            self._turned_away_at = time.monotonic()
        if isinstance(current, RelayClient):
            self.close(current)
            return None
        return current

    @staticmethod
    def close(current: Destination | None) -> None:
        """Close the reporter's connection, to the relay or to Redis (a closed reporter holds
        no server connection: at 16k ranks each one counts against ``maxclients``)."""
        if isinstance(current, RelayClient):
            current.close()
        elif current is not None:
            with contextlib.suppress(Exception):
                current.client.close()

    @staticmethod
    def sent_nothing(exc: Exception) -> bool:
        """True when the failed publish stored nothing anywhere (the relay turned the
        connection away before reading it, or refused the flush): sending it to Redis at
        once cannot store it twice."""
        return isinstance(exc, RelayTurnedAwayError | RelayRefusedError)

    def _relay(self) -> RelayClient | None:
        if self._relay_socket is None or self.refused:
            return None
        if time.monotonic() - self._turned_away_at < self.retry_s:
            return None
        self._relay_tried = time.monotonic()
        try:
            return RelayClient.connect(self._relay_socket)
        except OSError:
            return None  # no relay on this node (or it is restarting): publish ourselves
