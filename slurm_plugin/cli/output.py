"""Printing helpers shared by CLI commands: JSON for machines, aligned text for people."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import click

_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
#: Fields that name things: kept as text even when they look like numbers (job 5, rank ids).
_NAMES = {"job", "job_id", "id", "audit_id", "node", "of", "instance", "policy", "user", "by"}


def is_time_key(key: str) -> bool:
    """Fields holding a unix time: ``*_ts``, ``*_at``, ``ts`` and the node-history times."""
    return key.endswith(("_ts", "_at")) or key in {"ts", "last_incident", "persistent_since"}


def iso(ts: float) -> str:
    """A unix time as ISO 8601 with its zone (UTC), to the second."""
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")


def typed(record: Mapping[str, Any]) -> dict[str, Any]:
    """A Redis hash (all text) with its values typed back: JSON lists/objects parsed, numbers
    as numbers (names such as job ids stay text), times also as ``<key>_iso``."""
    out: dict[str, Any] = {}
    for key, raw in record.items():
        value = _parse(raw) if isinstance(raw, str) and key not in _NAMES else raw
        out[key] = value
        if is_time_key(key) and isinstance(value, int | float) and not isinstance(value, bool):
            out[f"{key}_iso"] = iso(float(value))
    return out


def _parse(text: str) -> Any:
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except ValueError:
            return text
    if _NUMBER.fullmatch(text):
        number = float(text)
        return int(number) if number.is_integer() and "." not in text else number
    return text


def cell(value: Any, key: str = "") -> str:
    """One table cell: '-' for nothing, lists joined by '; ', times in ISO 8601."""
    if value is None or value == "":
        return "-"
    if is_time_key(key) and isinstance(value, int | float) and not isinstance(value, bool):
        return iso(float(value))
    if isinstance(value, list | tuple):
        return "; ".join(cell(v) for v in value) or "-"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def emit_json(data: Any) -> None:
    """Print ``data`` as one JSON document on stdout."""
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (NUL, escapes, right-to-left
    overrides, newlines) shown as ``\\xNN`` / ``\\uNNNN`` escapes."""
    return "".join(
        c if c.isprintable() else (f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}")
        for c in text
    )


def emit_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Print rows as an aligned text table with the given columns (control characters
    escaped)."""
    cells = [[printable(cell(row.get(col), col)) for col in columns] for row in rows]
    widths = [max([len(col), *(len(r[i]) for r in cells)]) for i, col in enumerate(columns)]
    click.echo("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for r in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def emit_rows(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], *, as_json: bool) -> None:
    """Rows as JSON (every field) or as a table of ``columns``."""
    if as_json:
        emit_json(list(rows))
    else:
        emit_table(rows, columns)
