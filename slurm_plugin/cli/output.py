"""Printing helpers shared by CLI commands: JSON for machines, aligned text for people."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import click


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
    cells = [[printable(str(row.get(col, ""))) for col in columns] for row in rows]
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
