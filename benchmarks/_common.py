"""Helpers shared by the benchmarks: where Redis is, and how to print a table."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence


def redis_url() -> str:
    """The Redis to measure against: $STRAGGLER_REDIS_URL or the dev cluster's default."""
    return os.environ.get("STRAGGLER_REDIS_URL", "redis://127.0.0.1:16379/0")


def machine() -> str:
    """One line describing this machine."""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
