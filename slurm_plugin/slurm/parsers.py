"""Pure parsers for Slurm's text output (golden-tested; no subprocess here)."""

from __future__ import annotations

import re

import hostlist

from slurm_plugin.errors import SlurmError

# A new field starts at a space followed by ``Key=`` where Key is a Slurm field name. Values may
# contain spaces (Command=, Comment=, Reason=), so splitting on every space would be wrong.
_FIELD_START = re.compile(r"(?:^|\s)(?=[A-Z][A-Za-z0-9_:/]*=)")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """Parse one ``scontrol -o show job|node`` line into ``{Key: value}``."""
    record: dict[str, str] = {}
    for chunk in _FIELD_START.split(line.strip()):
        if not chunk:
            continue
        key, sep, value = chunk.partition("=")
        if not sep:
            raise SlurmError(f"cannot parse scontrol field {chunk[:60]!r}")
        record[key] = value.strip()
    if not record:
        raise SlurmError("empty scontrol record")
    return record


def expand_hostlist(expr: str) -> list[str]:
    """``node[1-3],gpu7`` -> ``["node1", "node2", "node3", "gpu7"]``; ``(null)``/empty -> []."""
    expr = expr.strip()
    if expr in {"", "(null)", "None"}:
        return []
    try:
        return list(hostlist.expand_hostlist(expr))
    except hostlist.BadHostlist as exc:
        raise SlurmError(f"bad hostlist {expr!r}: {exc}") from exc


def collect_hostlist(hosts: list[str]) -> str:
    """The compact Slurm form of ``hosts`` (``node[1-3]``)."""
    return str(hostlist.collect_hostlist(hosts)) if hosts else ""
