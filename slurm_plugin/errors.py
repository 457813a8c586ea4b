"""The exception hierarchy: one root, specific subclasses that carry their context.

Catch :class:`StragglerError` only at an entry point's boundary (the CLI, the service loop);
everywhere else catch the most specific subclass that applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class StragglerError(Exception):
    """Root of every error slurm-straggler raises on purpose."""


class ConfigError(StragglerError):
    """A settings file or value is invalid; names the file and the field when known."""

    def __init__(self, message: str, *, path: Path | None = None, field: str | None = None):
        self.path = path
        self.field = field
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{message}")


class CommandError(StragglerError):
    """An external command (scontrol, slurmd, ...) failed or could not be run."""

    def __init__(self, argv: Sequence[str], message: str, *, returncode: int | None = None):
        self.argv = list(argv)
        self.returncode = returncode
        super().__init__(f"{argv[0] if argv else '?'}: {message}")


class CommandTimeoutError(CommandError):
    """An external command did not finish within its timeout."""

    def __init__(self, argv: Sequence[str], timeout_s: float):
        self.timeout_s = timeout_s
        super().__init__(argv, f"timed out after {timeout_s:g} s")


class SlurmError(StragglerError):
    """Slurm refused a request or answered something we cannot parse."""


class JobNotFoundError(SlurmError):
    """Slurm answered, and does not know the job (finished and purged, or never existed)."""


class NotLeaderError(StragglerError):
    """This service instance no longer holds the leader lock: it must not act on Slurm."""


class RedisUnavailableError(StragglerError):
    """Redis could not be reached or answered with an error."""


class DevClusterError(StragglerError):
    """The local development cluster could not be brought up, inspected or down."""


class TelemetryError(StragglerError):
    """Telemetry that cannot be accepted: a bad key name or a malformed record."""


class TraceError(StragglerError):
    """A trace file that cannot be read; names the row and column."""


__all__ = [
    "CommandError",
    "CommandTimeoutError",
    "ConfigError",
    "DevClusterError",
    "JobNotFoundError",
    "NotLeaderError",
    "RedisUnavailableError",
    "SlurmError",
    "StragglerError",
    "TelemetryError",
    "TraceError",
]
