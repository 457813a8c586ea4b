"""The one place structlog is configured. Only entry points call :func:`configure_logging`.

Library code does ``log = structlog.get_logger(__name__)`` and emits events with stable names
and bound context (``job_id``, ``node``, ``decision_id``...).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(
    level: str = "info", *, json: bool | None = None, stream: TextIO | None = None
) -> None:
    """Configure structlog for this process.

    ``json=None`` picks JSON lines when ``stream`` is not a TTY and a readable console format
    when it is. Logs go to stderr by default so that stdout stays for data (``--json``).
    """
    out = stream if stream is not None else sys.stderr
    if level.lower() not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose one of {', '.join(_LEVELS)}")
    use_json = not out.isatty() if json is None else json
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.typing.Processor
    if use_json:
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer(sort_keys=True)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=out.isatty())
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level.lower()]),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
