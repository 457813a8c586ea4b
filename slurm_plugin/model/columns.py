"""Steps entries decoded straight into columns: the service's path from the stream to the
detector, with no object per step.

An entry is one rank's flush or a node relay's rows (``model.relayed``). Headers are read in
Python, once per entry; the steps of every entry are parsed in one call per kind (pyarrow's CSV
reader with the ``arrow`` extra, else numpy's text parser) and checked as arrays. An entry is
accepted or refused whole, on the rules of :func:`~slurm_plugin.model.records.decode_steps` (a
property test holds them to agree).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from slurm_plugin.errors import TelemetryError
from slurm_plugin.model.batch import RecordBatch
from slurm_plugin.model.records import FlushHeader, decode_header, decode_steps
from slurm_plugin.model.relayed import RelayedHeader, decode_relayed_header, is_relayed

_MAX_STEP = 2.0**53
H = TypeVar("H", FlushHeader, RelayedHeader)


@dataclass
class Decoded:
    """The believed-well-formed steps of some entries, in stream order."""

    batch: RecordBatch
    #: Per row, the index of its node in ``nodes`` (nodes are few; rows are many).
    node_code: np.ndarray
    nodes: list[str]
    #: Entries refused, and the reason of the first few.
    malformed: int = 0
    errors: list[str] = field(default_factory=list)


def decode_entries(entries: Sequence[Mapping[str, str]], keep_errors: int = 5) -> Decoded:
    """Every entry that decodes, as columns; the others are counted (``malformed``)."""
    decoded, _, refused = _decode(entries)
    decoded.malformed = len(refused)
    decoded.errors = [why for _, why in sorted(refused)[:keep_errors]]
    return decoded


def decode_many(
    groups: Sequence[Sequence[Mapping[str, str]]], keep_errors: int = 5
) -> list[Decoded]:
    """:func:`decode_entries` of each group (a job's entries), with one parse for all of them:
    the service's cycle decodes every running job's new entries at once (a parse costs about a
    millisecond however few rows it has). Each group's nodes are its own."""
    flat = [fields for group in groups for fields in group]
    whole, row_entry, refused = _decode(flat)
    ends = np.cumsum([len(group) for group in groups])
    starts = ends - np.asarray([len(group) for group in groups], dtype=np.int64)
    first_row = np.searchsorted(row_entry, starts, side="left")
    last_row = np.searchsorted(row_entry, ends, side="left")
    refused.sort()
    bad_entry = np.asarray([i for i, _ in refused], dtype=np.int64)
    out = []
    bad_starts = np.searchsorted(bad_entry, starts, side="left").tolist()
    bad_ends = np.searchsorted(bad_entry, ends, side="left").tolist()
    for lo, hi, a, b in zip(
        first_row.tolist(), last_row.tolist(), bad_starts, bad_ends, strict=True
    ):
        rows = slice(lo, hi)  # a group's rows are contiguous: views, not copies
        codes, local = _local_codes(whole.node_code[rows])
        out.append(
            Decoded(
                whole.batch.take(rows),
                local,
                [whole.nodes[c] for c in codes],
                b - a,
                [why for _, why in refused[a : min(b, a + keep_errors)]],
            )
        )
    return out


def _local_codes(codes: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The distinct node codes of a group's rows and each row's index among them; one node
    (a job of one node, a relay's entries) without a sort."""
    if len(codes) and codes[0] == codes[-1] and (codes == codes[0]).all():
        return [int(codes[0])], np.zeros(len(codes), dtype=np.int64)
    distinct, local = np.unique(codes, return_inverse=True)
    return distinct.tolist(), local.astype(np.int64)


def _decode(
    entries: Sequence[Mapping[str, str]],
) -> tuple[Decoded, np.ndarray, list[tuple[int, str]]]:
    """The believed rows of ``entries``, each row's entry index (ascending), and the refused
    entries with why."""
    flushes: list[tuple[int, FlushHeader]] = []
    relayed: list[tuple[int, RelayedHeader]] = []
    errors: list[tuple[int, str]] = []
    for index, fields in enumerate(entries):
        try:
            if is_relayed(fields):
                relayed.append((index, decode_relayed_header(fields)))
                continue
            head = decode_header(fields)
        except TelemetryError as exc:
            errors.append((index, str(exc)))
            continue
        if head.regular:
            flushes.append((index, head))
        else:  # decode_steps names what is wrong, or refuses the text
            errors.append((index, _why(fields)))
    parts = [_flush_columns(flushes, errors), _relayed_columns(relayed, errors)]
    nodes: dict[str, int] = {}
    for part in parts:  # a node's code per entry (few), then per row
        codes = [nodes.setdefault(n, len(nodes)) for n in part.pop("entry_node")]
        part["code"] = np.asarray(codes, dtype=np.int64)[part.pop("row_entry")]
    entry = np.concatenate([p["entry"] for p in parts])
    order = np.argsort(entry, kind="stable")
    cols = {k: np.concatenate([p[k] for p in parts])[order] for k in parts[0] if k != "entry"}
    names = list(nodes)
    code = cols["code"].astype(np.int64)
    groups = cols["group"]
    batch = RecordBatch(
        rank=cols["rank"].astype(np.int64),
        step=cols["step"].astype(np.int64),
        attempt=cols["attempt"].astype(np.int64),
        gpu=cols["gpu"].astype(np.int64),
        ts=cols["ts"],
        step_s=cols["step_s"],
        compute_s=cols["compute_s"],
        comm_s=cols["comm_s"],
        data_s=cols["data_s"],
        node=np.asarray(names, dtype=object)[code] if names else np.empty(0, dtype=object),
        group=groups if any(groups) else None,
    )
    return Decoded(batch, code, names), entry[order].astype(np.int64), errors


def _why(fields: Mapping[str, str]) -> str:
    try:
        decode_steps("?", fields)
    except TelemetryError as exc:
        return str(exc)
    return "steps hold a token out of place"  # pragma: no cover - regular=False always raises


def _parse(texts: list[str], width: int) -> np.ndarray | None:
    """``texts`` as rows of ``width`` numbers ("-": NaN); None when a token is not a number."""
    if not texts:
        return np.empty((0, width))
    arrow = _arrow()
    if arrow is not None:
        return _parse_arrow(arrow, texts, width)
    # "-" stands alone (a line starts with digits; an exponent's "-" follows an "e"): as
    # "nan" numpy's C parser reads it. A negative number turns into a token it refuses.
    text = " ".join(texts).replace(" -", " nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns where it stops at a token it cannot read
        try:
            values = np.fromstring(text, dtype=np.float64, sep=" ")
        except (ValueError, DeprecationWarning):
            return None
    if len(values) % width or len(values) != text.count(" ") + text.count("\n") + 1:
        return None  # a token it read only in part
    return values.reshape(-1, width)


@functools.cache
def _arrow() -> tuple[Any, Any] | None:
    """pyarrow and its CSV reader when installed (the ``arrow`` extra): it parses these rows
    about ten times faster than numpy's text parser, on every core."""
    try:
        import pyarrow  # noqa: PLC0415 - optional: the service host installs it
        import pyarrow.csv  # noqa: PLC0415
    except ImportError:
        return None
    return pyarrow, pyarrow.csv


def _parse_arrow(arrow: tuple[Any, Any], texts: list[str], width: int) -> np.ndarray | None:
    """:func:`_parse` by pyarrow: one row per line, fields one space apart, exactly ``width``
    of them; no quoting, no empty field; "-" is the only missing value."""
    pa, pacsv = arrow
    text = "\n".join(texts)
    names = [str(i) for i in range(width)]
    try:
        table = pacsv.read_csv(
            pa.BufferReader(text.encode()),
            read_options=pacsv.ReadOptions(column_names=names),
            parse_options=pacsv.ParseOptions(
                delimiter=" ", quote_char=False, escape_char=False, ignore_empty_lines=False
            ),
            convert_options=pacsv.ConvertOptions(
                column_types=dict.fromkeys(names, pa.float64()),
                null_values=["-"],
                strings_can_be_null=False,
            ),
        )
    except pa.ArrowException:
        return None
    if table.num_rows != text.count("\n") + 1:
        return None
    return np.column_stack([column.to_numpy() for column in table.columns])


def _parse_each(texts: list[str], counts: list[int], width: int) -> np.ndarray:
    """Like :func:`_parse`, text by text and with Python's float() (it reads "-0", which the
    record decoder accepts); a text with a token it refuses gives rows of -1 (out of range)."""
    rows = []
    for text, count in zip(texts, counts, strict=True):
        tokens = np.array(text.split(), dtype=object)
        tokens[tokens == "-"] = "nan"  # only "-" can become NaN: the texts hold no letters
        try:
            rows.append(tokens.astype(np.float64).reshape(count, width))
        except ValueError:
            rows.append(np.full((count, width), -1.0))
    return np.concatenate(rows) if rows else np.empty((0, width))


def _steps_ok(values: np.ndarray) -> np.ndarray:
    """Per row of (step, ts, step_s, compute_s, comm_s, data_s): an integer step >= 0, finite
    ts and step_s >= 0, phases finite >= 0 or NaN."""
    step, required, phases = values[:, 0], values[:, 1:3], values[:, 3:]
    with np.errstate(invalid="ignore"):
        ok = (step >= 0) & (step < _MAX_STEP) & (np.floor(step) == step)
        ok &= np.all(np.isfinite(required) & (required >= 0), axis=1)
        ok &= np.all(np.isnan(phases) | (np.isfinite(phases) & (phases >= 0)), axis=1)
    return np.asarray(ok)


def _rows(
    entry: list[int], counts: list[int], values: np.ndarray, ok_rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per entry whether all its rows are fine, and the row -> entry position map."""
    owner = np.repeat(np.arange(len(entry)), counts)
    bad = np.zeros(len(entry), dtype=bool)
    bad[owner[~ok_rows]] = True
    return ~bad, owner


def _values(
    items: list[tuple[int, H]], width: int
) -> tuple[list[int], list[H], list[int], np.ndarray]:
    """Entry positions, headers, row counts, and the rows of every entry in one parse (entry
    by entry when one holds a bad token)."""
    entry = [i for i, _ in items]
    heads = [h for _, h in items]
    counts = [h.count for h in heads]
    texts = [h.text for h in heads]
    values = _parse([t for t, c in zip(texts, counts, strict=True) if c], width)
    if values is None:
        values = _parse_each(texts, counts, width)
    return entry, heads, counts, values


def _flush_columns(
    flushes: list[tuple[int, FlushHeader]], errors: list[tuple[int, str]]
) -> dict[str, np.ndarray]:
    entry, heads, counts, values = _values(flushes, 6)
    good, owner = _rows(entry, counts, values, _steps_ok(values))
    errors += [
        (i, f"rank {h.rank}: a step's value is out of range")
        for i, h, g in zip(entry, heads, good, strict=True)
        if not g
    ]
    keep = good[owner]
    row_owner = owner[keep]
    per = {
        "rank": np.array([h.rank for h in heads], dtype=np.int64),
        "gpu": np.array([h.gpu for h in heads], dtype=np.int64),
        "attempt": np.array([h.attempt for h in heads], dtype=np.int64),
        "group": np.array([h.group for h in heads], dtype=object),
        "entry": np.array(entry, dtype=np.int64),
    }
    cols = {k: v[row_owner] for k, v in per.items()}
    nodes = [h.node for h in heads]
    return {**cols, **_step_columns(values[keep]), "entry_node": nodes, "row_entry": row_owner}


def _relayed_columns(
    relayed: list[tuple[int, RelayedHeader]], errors: list[tuple[int, str]]
) -> dict[str, np.ndarray]:
    entry, heads, counts, values = _values(relayed, 10)
    owner = np.repeat(np.arange(len(heads)), counts)
    labels = np.array([len(h.groups) for h in heads], dtype=np.int64)
    ok_rows = (
        _steps_ok(values[:, 4:])
        & (values[:, 3] <= labels[owner])
        & (values[:, :4] >= 0).all(axis=1)
    )
    good, owner = _rows(entry, counts, values, ok_rows)
    errors += [
        (i, f"relayed entry of {h.node}: a row is out of range")
        for i, h, g in zip(entry, heads, good, strict=True)
        if not g
    ]
    keep = good[owner]
    row_owner, kept = owner[keep], values[keep]
    # Every entry's labels in one table ("" first for each): a row's label is at its entry's
    # offset plus its index.
    table = np.array([label for h in heads for label in ("", *h.groups)], dtype=object)
    offsets = np.cumsum([0] + [1 + len(h.groups) for h in heads])[:-1].astype(np.int64)
    index = offsets[row_owner] + kept[:, 3].astype(np.int64)
    return {
        "rank": kept[:, 0],
        "gpu": kept[:, 1],
        "attempt": kept[:, 2],
        "group": table[index] if len(kept) else np.empty(0, dtype=object),
        "entry": np.array(entry, dtype=np.int64)[row_owner],
        **_step_columns(kept[:, 4:]),
        "entry_node": [h.node for h in heads],
        "row_entry": row_owner,
    }


def _step_columns(values: np.ndarray) -> dict[str, np.ndarray]:
    names = ("step", "ts", "step_s", "compute_s", "comm_s", "data_s")
    return {name: values[:, i] for i, name in enumerate(names)}
