"""Rank flushes decoded straight into columns: the service's path from stream entries to the
detector, with no object per step.

Each flush's header is read in Python (a few fields, once per flush); the steps of every flush
are parsed in one numpy call and checked as arrays. A flush is accepted or refused whole, on
the same rules as :func:`~slurm_plugin.model.records.decode_steps` (tested to agree).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from slurm_plugin.errors import TelemetryError
from slurm_plugin.model.batch import RecordBatch
from slurm_plugin.model.records import FlushHeader, decode_header, decode_steps

#: Steps are parsed at most this many flushes at a time (bounds the text held at once).
_CHUNK = 50_000
_MAX_STEP = 2.0**53


@dataclass
class Flushes:
    """Decoded flushes: per flush its header values, per step its six numbers."""

    rank: np.ndarray
    gpu: np.ndarray
    attempt: np.ndarray
    count: np.ndarray
    node: list[str]
    group: list[str]
    #: Rows of (step, ts, step_s, compute_s, comm_s, data_s); NaN for a phase not measured.
    steps: np.ndarray
    #: Flushes refused, and the reason of the first few.
    malformed: int = 0
    errors: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rank)

    def batch(self, keep: np.ndarray | None = None) -> RecordBatch:
        """The steps as a :class:`RecordBatch`, of the flushes in ``keep`` (a mask) only."""
        flushes = np.arange(len(self.rank))
        if keep is None:
            rows, steps = np.repeat(flushes, self.count), self.steps
        else:
            rows = np.repeat(flushes[keep], self.count[keep])
            steps = self.steps[np.repeat(keep, self.count)]
        nodes = np.asarray(self.node, dtype=object)[rows]
        groups = np.asarray(self.group, dtype=object)[rows] if any(self.group) else None
        return RecordBatch(
            rank=self.rank[rows],
            step=steps[:, 0].astype(np.int64),
            attempt=self.attempt[rows],
            gpu=self.gpu[rows],
            ts=steps[:, 1],
            step_s=steps[:, 2],
            compute_s=steps[:, 3],
            comm_s=steps[:, 4],
            data_s=steps[:, 5],
            node=nodes,
            group=groups,
        )


def decode_flushes(flushes: Sequence[Mapping[str, str]], keep_errors: int = 5) -> Flushes:
    """Every flush that decodes, as columns; the others are counted (``malformed``)."""
    heads: list[FlushHeader] = []
    errors: list[str] = []
    malformed = 0
    for fields in flushes:
        try:
            head = decode_header(fields)
        except TelemetryError as exc:
            malformed += 1
            if len(errors) < keep_errors:
                errors.append(str(exc))
            continue
        if not head.regular:  # decode_steps names what is wrong, or refuses the text
            malformed += 1
            if len(errors) < keep_errors:
                errors.append(_why(fields))
            continue
        heads.append(head)
    good, parsed = _parse_steps(heads)
    if not all(good):
        bad = [h for h, ok in zip(heads, good, strict=True) if not ok]
        malformed += len(bad)
        for head in bad[: max(0, keep_errors - len(errors))]:
            errors.append(f"rank {head.rank}: a step's value is out of range")
        heads = [h for h, ok in zip(heads, good, strict=True) if ok]
    return Flushes(
        rank=np.fromiter((h.rank for h in heads), np.int64, len(heads)),
        gpu=np.fromiter((h.gpu for h in heads), np.int64, len(heads)),
        attempt=np.fromiter((h.attempt for h in heads), np.int64, len(heads)),
        count=np.fromiter((h.count for h in heads), np.int64, len(heads)),
        node=[h.node for h in heads],
        group=[h.group for h in heads],
        steps=parsed,
        malformed=malformed,
        errors=errors,
    )


def _why(fields: Mapping[str, str]) -> str:
    try:
        decode_steps("?", fields)
    except TelemetryError as exc:
        return str(exc)
    return "steps hold a token out of place"  # pragma: no cover - regular=False always raises


def _parse_steps(heads: Sequence[FlushHeader]) -> tuple[list[bool], np.ndarray]:
    """The steps of ``heads`` as rows, and per flush whether all its values are in range
    (only those flushes' rows are returned)."""
    parts, good = [], []
    for begin in range(0, len(heads), _CHUNK):
        chunk = heads[begin : begin + _CHUNK]
        text = " ".join(h.text for h in chunk if h.count)
        tokens = np.array(text.split(), dtype=object)
        tokens[tokens == "-"] = "nan"  # only "-" can become NaN: the text holds no letters
        try:
            values = tokens.astype(np.float64).reshape(-1, 6)
        except ValueError:  # a token float() refuses ("1.2.3"): judge flush by flush
            values = _parse_one_by_one(chunk)
        counts = np.fromiter((h.count for h in chunk), np.int64, len(chunk))
        ok_rows = _rows_in_range(values)
        owner = np.repeat(np.arange(len(chunk)), counts)
        bad = np.zeros(len(chunk), dtype=bool)
        bad[owner[~ok_rows]] = True
        good.extend((~bad).tolist())
        parts.append(values[~bad[owner]])
    rows = np.concatenate(parts) if parts else np.empty((0, 6))
    return good, rows


def _parse_one_by_one(chunk: Sequence[FlushHeader]) -> np.ndarray:
    """The chunk's rows, those of a flush with an unparsable token set to -1 (out of range)."""
    rows = []
    for head in chunk:
        if not head.count:
            continue
        tokens = ["nan" if t == "-" else t for t in head.text.split()]
        try:
            rows.append(np.array(tokens, dtype=np.float64).reshape(-1, 6))
        except ValueError:
            rows.append(np.full((head.count, 6), -1.0))
    return np.concatenate(rows) if rows else np.empty((0, 6))


def _rows_in_range(values: np.ndarray) -> np.ndarray:
    """Per row: an integer step >= 0, finite ts and step_s >= 0, phases finite >= 0 or NaN."""
    step, required, phases = values[:, 0], values[:, 1:3], values[:, 3:]
    with np.errstate(invalid="ignore"):
        ok = (step >= 0) & (step < _MAX_STEP) & (np.floor(step) == step)
        ok &= np.all(np.isfinite(required) & (required >= 0), axis=1)
        ok &= np.all(np.isnan(phases) | (np.isfinite(phases) & (phases >= 0)), axis=1)
    return np.asarray(ok)
