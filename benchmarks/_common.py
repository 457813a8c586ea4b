"""Helpers shared by the benchmarks: where Redis is, and how to print a table."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence

import redis


def redis_url() -> str:
    """The Redis to measure against: $STRAGGLER_REDIS_URL or the dev cluster's default."""
    return os.environ.get("STRAGGLER_REDIS_URL", "redis://127.0.0.1:16379/0")


def empty_redis() -> tuple[str, redis.Redis]:
    """The Redis to run a service in, and a client of it. Its database must be empty: the
    benchmark deletes what it wrote, which is then everything there (never a database it did
    not create the keys of)."""
    url = redis_url()
    client = redis.Redis.from_url(url)
    if client.dbsize():
        raise SystemExit(
            f"the Redis database of STRAGGLER_REDIS_URL ({url}) is not empty; point it at an "
            "empty one (the benchmark runs a service there and deletes what it wrote)"
        )
    return url, client


def clear(client: redis.Redis) -> None:
    """Delete every key of the database :func:`empty_redis` found empty (all ours)."""
    for key in client.scan_iter(count=1000):
        client.delete(key)


def machine() -> str:
    """One line describing this machine."""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
