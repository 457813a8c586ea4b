"""Logging: JSON lines off a terminal, readable text on one; stable event names."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from slurm_plugin.logging import configure_logging


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_when_not_a_tty() -> None:
    """A non-TTY stream gets one JSON object per event with level, timestamp and context."""
    stream = io.StringIO()
    configure_logging("info", stream=stream)
    structlog.get_logger("t").info("job.registered", job_id="42", node="node1")
    record = json.loads(stream.getvalue().strip())
    assert record["event"] == "job.registered"
    assert record["job_id"] == "42"
    assert record["level"] == "info"
    assert "timestamp" in record


def test_console_format_on_a_tty() -> None:
    """A TTY gets human-readable text, not JSON."""
    stream = _Tty()
    configure_logging("info", stream=stream)
    structlog.get_logger("t").info("job.registered", job_id="42")
    text = stream.getvalue()
    assert "job.registered" in text
    assert "job_id" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_level_filters_and_bad_level_is_rejected() -> None:
    """Events below the level are dropped; an unknown level is a clear error."""
    stream = io.StringIO()
    configure_logging("warning", stream=stream)
    structlog.get_logger("t").info("quiet")
    structlog.get_logger("t").warning("loud")
    assert "quiet" not in stream.getvalue()
    assert "loud" in stream.getvalue()
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("chatty")
