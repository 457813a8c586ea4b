"""The steps entry a node relay writes: the flushes of many ranks of one node, as rows.

Fields: ``node`` (the relay's own), ``flush`` (the relay's id for the entry, session.sequence,
so a write Redis stored before the relay gave up on it is read once), ``groups`` (the peer
group labels its rows use, space-separated), ``n`` and ``rows``: ``n`` lines of
``rank gpu attempt g step ts step_s compute_s comm_s data_s`` where ``g`` is 0 (no group) or the
1-based index of the rank's label in ``groups``. The relay checked every flush it packs with
the record decoder; readers check the entry again, as a whole.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurm_plugin.errors import TelemetryError
from slurm_plugin.model.records import FlushHeader, check_group, non_negative_int

#: Rows one relayed entry may hold (a node's ranks, at most 100 steps per flush).
MAX_ROWS = 200_000
_VALUE = r"[-+.e0-9]{1,32}"
_ROW = rf"[0-9]{{1,9}} [0-9]{{1,4}} [0-9]{{1,9}} [0-9]{{1,5}} [0-9]{{1,15}}(?: {_VALUE}){{5}}"
ROWS_TEXT = re.compile(f"{_ROW}(?:\\n{_ROW})*")


def is_relayed(fields: Mapping[str, str]) -> bool:
    """True for a relay's entry (it has ``rows``), False for one rank's flush."""
    return "rows" in fields


def encode_relayed(node: str, flushes: Sequence[FlushHeader], flush: str) -> dict[str, str]:
    """One steps entry for ``flushes`` (already checked) of ranks on ``node``."""
    groups: dict[str, int] = {}
    lines = []
    for head in flushes:
        if not head.count:
            continue
        g = groups.setdefault(head.group, len(groups) + 1) if head.group else 0
        prefix = f"{head.rank} {head.gpu} {head.attempt} {g} "
        lines.append(prefix + head.text.replace("\n", "\n" + prefix))
    rows = "\n".join(lines)
    return {
        "node": node,
        "flush": flush,
        "groups": " ".join(groups),
        "n": str(rows.count("\n") + 1 if rows else 0),
        "rows": rows,
    }


@dataclass(frozen=True)
class RelayedHeader:
    """A relayed entry's node, group labels, row count and rows text, checked."""

    node: str
    groups: list[str]
    count: int
    text: str


def decode_relayed_header(fields: Mapping[str, str]) -> RelayedHeader:
    """The entry's header; :class:`TelemetryError` when it is not a well-formed relay entry."""
    node = fields.get("node", "")
    if not node:
        raise TelemetryError("relayed entry lacks field 'node'")
    groups = [check_group(g) for g in fields.get("groups", "").split()]
    count = non_negative_int(fields.get("n", ""), "n")
    if count > MAX_ROWS:
        raise TelemetryError(f"relayed entry claims {count} rows (max {MAX_ROWS})")
    text = fields.get("rows", "") if count else ""
    lines = text.count("\n") + 1 if count else 0
    if lines != count:
        raise TelemetryError(f"relayed entry says n={count} but holds {lines} rows")
    if count and not ROWS_TEXT.fullmatch(text):
        raise TelemetryError(f"relayed rows hold a token out of place: {text[:60]!r}")
    return RelayedHeader(node, groups, count, text)
