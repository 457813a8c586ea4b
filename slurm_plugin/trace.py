"""The trace format (CSV) shared by ``straggler export`` and ``straggler backtest``.

Header ``job_id,rank,node,gpu,step,ts,step_s,compute_s,comm_s,data_s``; ``ts`` is unix seconds
at step end; empty phase cells mean "not measured".
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from slurm_plugin.errors import TraceError
from slurm_plugin.model.records import StepRecord

TRACE_COLUMNS = (
    "job_id",
    "rank",
    "node",
    "gpu",
    "step",
    "ts",
    "step_s",
    "compute_s",
    "comm_s",
    "data_s",
    "group",
)


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.9g}"


def write_trace(records: Iterable[StepRecord], out: TextIO) -> int:
    """Write records as trace CSV; returns the number of rows."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(TRACE_COLUMNS)
    rows = 0
    for r in records:
        writer.writerow(
            [
                r.job_id,
                r.rank,
                r.node,
                r.gpu,
                r.step,
                f"{r.ts:.6f}",
                _cell(r.step_s),
                _cell(r.compute_s),
                _cell(r.comm_s),
                _cell(r.data_s),
                r.group,
            ]
        )
        rows += 1
    return rows


REQUIRED_COLUMNS = ("job_id", "rank", "node", "step", "ts", "step_s")
OPTIONAL_COLUMNS = ("gpu", "compute_s", "comm_s", "data_s", "group")


@dataclass
class Trace:
    """A trace as columns, in ts order."""

    job_id: np.ndarray
    node: np.ndarray
    rank: np.ndarray
    gpu: np.ndarray
    step: np.ndarray
    ts: np.ndarray
    step_s: np.ndarray
    compute_s: np.ndarray
    comm_s: np.ndarray
    data_s: np.ndarray
    #: The rank's peer group per record ("" = none; the column is optional).
    group: np.ndarray

    def __len__(self) -> int:
        return len(self.ts)


def _numbers(values: list[str], name: str, *, integer: bool, optional: bool) -> np.ndarray:
    if optional:
        values = [v if v else "nan" for v in values]
    try:
        out = np.array(values, dtype=np.float64)
    except ValueError:
        for row, text in enumerate(values, start=2):
            try:
                float(text)
            except ValueError:
                raise TraceError(
                    f"row {row}: column {name!r}: not a number: {text[:30]!r}"
                ) from None
        raise
    if not optional and not np.isfinite(out).all():
        row = int(np.flatnonzero(~np.isfinite(out))[0]) + 2
        raise TraceError(f"row {row}: column {name!r} must be finite")
    if integer:
        if not np.all(np.isnan(out) | (out == np.round(out))):
            row = int(np.flatnonzero(out != np.round(out))[0]) + 2
            raise TraceError(f"row {row}: column {name!r} must be an integer")
        return np.nan_to_num(out, nan=0.0).astype(np.int64)
    return out


def read_trace(source: TextIO, *, name: str = "trace") -> Trace:
    """Parse trace CSV; :class:`TraceError` names the row and column of any problem.

    Complete numeric tables take numpy's C parser; anything else (empty phase cells, quoted
    fields, bad values) takes the careful path, which also finds the offending row.
    """
    text = source.read()
    first_line, _, _ = text.partition("\n")
    try:
        header = [h.strip() for h in next(csv.reader([first_line]), [])]
    except csv.Error as exc:
        raise TraceError(f"{name}: header is not CSV: {exc}") from None
    if not header or header == [""]:
        raise TraceError(f"{name}: empty file (no header)")
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise TraceError(
            f"{name}: missing column(s) {', '.join(missing)}; "
            f"the header must include {', '.join(REQUIRED_COLUMNS)}"
        )
    if not text[len(first_line) + 1 :].strip():
        raise TraceError(f"{name}: no records after the header")
    try:
        trace = _fast(text, header) if '"' not in text else None
    except ValueError:
        trace = None
    if trace is None:
        trace = _careful(text, header, name)
    if not len(trace):
        raise TraceError(f"{name}: no records after the header")
    if (trace.rank < 0).any() or (trace.step < 0).any():
        raise TraceError(f"{name}: rank and step must be >= 0")
    if len(trace) > 1 and not (np.diff(trace.ts) >= 0).all():
        order = np.argsort(trace.ts, kind="stable")
        trace = Trace(*(getattr(trace, f)[order] for f in Trace.__dataclass_fields__))
    return trace


_NUMERIC = ("rank", "gpu", "step", "ts", "step_s", "compute_s", "comm_s", "data_s")
_INTEGER = ("rank", "gpu", "step")


def _fast(text: str, header: list[str]) -> Trace | None:
    present = [c for c in _NUMERIC if c in header]
    numbers = np.loadtxt(
        io.StringIO(text),
        delimiter=",",
        skiprows=1,
        ndmin=2,
        usecols=[header.index(c) for c in present],
        dtype=np.float64,
    )
    if not len(numbers) or not np.isfinite(numbers).all():
        return None
    values = dict(zip(present, numbers.T, strict=True))
    for key in _INTEGER:
        if key in values and not (values[key] == np.round(values[key])).all():
            return None
    text_columns = ["job_id", "node", *(["group"] if "group" in header else [])]
    strings = np.loadtxt(
        io.StringIO(text),
        delimiter=",",
        skiprows=1,
        ndmin=2,
        dtype=str,
        usecols=[header.index(c) for c in text_columns],
    )
    n = len(numbers)

    def get(key: str, integer: bool) -> np.ndarray:
        if key not in values:
            return np.zeros(n, dtype=np.int64) if integer else np.full(n, np.nan)
        column: np.ndarray = values[key]
        return column.astype(np.int64) if integer else column

    return Trace(
        job_id=strings[:, 0],
        node=strings[:, 1].astype(object),
        rank=get("rank", True),
        gpu=get("gpu", True),
        step=get("step", True),
        ts=get("ts", False),
        step_s=get("step_s", False),
        compute_s=get("compute_s", False),
        comm_s=get("comm_s", False),
        data_s=get("data_s", False),
        group=strings[:, 2].astype(object) if "group" in header else np.full(n, "", dtype=object),
    )


def _careful(text: str, header: list[str], name: str) -> Trace:
    reader = csv.reader(io.StringIO(text))
    try:
        next(reader)
        rows = [row for row in reader if row]
    except csv.Error as exc:
        raise TraceError(f"{name}: row {reader.line_num}: not CSV: {exc}") from None
    if not rows:
        raise TraceError(f"{name}: no records after the header")
    width = len(header)
    for i, row in enumerate(rows, start=2):
        if len(row) != width:
            raise TraceError(f"{name}: row {i} has {len(row)} fields, the header {width}")
    columns = dict(zip(header, (list(c) for c in zip(*rows, strict=True)), strict=True))
    n = len(rows)

    def column(key: str, *, integer: bool = False, optional: bool = False) -> np.ndarray:
        if key not in columns:
            return np.zeros(n, dtype=np.int64) if integer else np.full(n, np.nan)
        try:
            return _numbers(columns[key], key, integer=integer, optional=optional)
        except TraceError as exc:
            raise TraceError(f"{name}: {exc}") from None

    return Trace(
        job_id=np.array(columns["job_id"]),
        node=np.array(columns["node"], dtype=object),
        rank=column("rank", integer=True),
        gpu=column("gpu", integer=True, optional=True),
        step=column("step", integer=True),
        ts=column("ts"),
        step_s=column("step_s"),
        compute_s=column("compute_s", optional=True),
        comm_s=column("comm_s", optional=True),
        data_s=column("data_s", optional=True),
        group=np.array(columns.get("group", [""] * n), dtype=object),
    )
