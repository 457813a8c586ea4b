"""The trace format (CSV) shared by ``straggler export`` and ``straggler backtest``.

Header ``job_id,rank,node,gpu,step,ts,step_s,compute_s,comm_s,data_s[,group]``; ``ts`` is unix
seconds at step end; empty phase cells mean "not measured".

Reading takes one pass: pyarrow's CSV reader (the ``arrow`` extra) when it is installed,
with names as dictionary codes; anything it refuses, and every read without pyarrow, takes the
careful path (Python's csv module), which also names the row and column of a problem.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TextIO

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
_NAMES = ("job_id", "node", "group")
_INTEGER = ("rank", "gpu", "step")
_FLOAT = ("ts", "step_s", "compute_s", "comm_s", "data_s")


@dataclass
class Trace:
    """A trace as columns, in ts order. Names (job, node, group) are codes into sorted lists
    of the distinct names."""

    job_code: np.ndarray
    job_names: list[str]
    node_code: np.ndarray
    node_names: list[str]
    #: The rank's peer group per record ("" = none; the column is optional).
    group_code: np.ndarray
    group_names: list[str]
    rank: np.ndarray
    gpu: np.ndarray
    step: np.ndarray
    ts: np.ndarray
    step_s: np.ndarray
    compute_s: np.ndarray
    comm_s: np.ndarray
    data_s: np.ndarray

    def __len__(self) -> int:
        return len(self.ts)

    @property
    def job_id(self) -> np.ndarray:
        """Each record's job id."""
        return _decode(self.job_names, self.job_code)

    @property
    def node(self) -> np.ndarray:
        """Each record's node."""
        return _decode(self.node_names, self.node_code)

    @property
    def group(self) -> np.ndarray:
        """Each record's peer group ("" = none)."""
        return _decode(self.group_names, self.group_code)

    @property
    def labelled(self) -> bool:
        """Some record names a peer group."""
        used = np.flatnonzero(np.bincount(self.group_code, minlength=len(self.group_names)))
        return any(self.group_names[c] for c in used.tolist())

    def take(self, index: np.ndarray) -> Trace:
        """The records at ``index`` (positions or a mask), names kept."""
        values: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = value if isinstance(value, list) else value[index]
        return Trace(**values)


def concat_traces(traces: list[Trace]) -> Trace:
    """One trace of several (names merged, records in ts order): node history then carries
    across all of them, as the service's does across jobs."""
    if len(traces) == 1:
        return traces[0]
    merged: dict[str, Any] = {}
    for f in fields(Trace):
        if f.name.endswith("_names"):
            merged[f.name] = sorted({n for t in traces for n in getattr(t, f.name)})
    for f in fields(Trace):
        if f.name.endswith("_names"):
            continue
        if f.name.endswith("_code"):
            names = f.name.replace("_code", "_names")
            table = merged[names]
            parts = [
                np.searchsorted(table, np.asarray(getattr(t, names), dtype=object))[
                    getattr(t, f.name)
                ].astype(np.int64)
                if len(getattr(t, names))
                else getattr(t, f.name)
                for t in traces
            ]
        else:
            parts = [getattr(t, f.name) for t in traces]
        merged[f.name] = np.concatenate(parts)
    trace = Trace(**merged)
    return trace.take(np.argsort(trace.ts, kind="stable"))


def _decode(names: list[str], codes: np.ndarray) -> np.ndarray:
    table: np.ndarray = np.asarray(names, dtype=object)
    out: np.ndarray = table[codes]
    return out


def read_trace(source: TextIO | Path, *, name: str | None = None) -> Trace:
    """Parse trace CSV (an open text file or a path); :class:`TraceError` names the row and
    column of any problem."""
    name = name or (str(source) if isinstance(source, Path) else "trace")
    try:
        if isinstance(source, Path):  # pyarrow reads the file itself; the text only if needed
            with source.open(newline="", encoding="utf-8-sig") as handle:
                header = _header(handle.readline(), name)
            trace = _fast(source, header)
            if trace is None:
                with source.open(newline="", encoding="utf-8-sig") as handle:
                    trace = _careful(handle.read(), header, name)
        else:
            text = source.read().removeprefix("\ufeff")
            header = _header(text.partition("\n")[0], name)
            trace = _fast(text.encode(), header)
            if trace is None:
                trace = _careful(text, header, name)
    except UnicodeDecodeError as exc:
        raise TraceError(
            f"{name}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8"
        ) from None
    if not len(trace):
        raise TraceError(f"{name}: no records after the header")
    if (trace.rank < 0).any() or (trace.step < 0).any():
        raise TraceError(f"{name}: rank and step must be >= 0")
    if len(trace) > 1 and not (trace.ts[1:] >= trace.ts[:-1]).all():
        trace = trace.take(np.argsort(trace.ts, kind="stable"))
    return trace


def _header(first_line: str, name: str) -> list[str]:
    try:
        header = [h.strip() for h in next(csv.reader([first_line.rstrip("\r\n")]), [])]
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
    return header


def _categories(values: np.ndarray, names: list[str]) -> tuple[np.ndarray, list[str]]:
    """Codes into ``names`` remapped to codes into the sorted distinct names."""
    if names == sorted(names):
        return values.astype(np.int64), names
    ordered, inverse = np.unique(np.asarray(names, dtype=object), return_inverse=True)
    return inverse.astype(np.int64)[values], [str(n) for n in ordered]


def _fast(source: Path | bytes, header: list[str]) -> Trace | None:
    """pyarrow's reader (multi-threaded, one pass); None where it is not installed or refuses
    the input (the careful path then finds the problem)."""
    try:
        import pyarrow as pa  # noqa: PLC0415 - the optional arrow extra
        import pyarrow.csv as pacsv  # noqa: PLC0415
    except ImportError:
        return None
    wanted = [c for c in TRACE_COLUMNS if c in header]
    names = pa.dictionary(pa.int32(), pa.string())
    types = {
        c: names if c in _NAMES else pa.int64() if c in _INTEGER else pa.float64() for c in wanted
    }
    try:
        table = pacsv.read_csv(
            str(source) if isinstance(source, Path) else pa.BufferReader(source),
            read_options=pacsv.ReadOptions(column_names=header, skip_rows=1),
            parse_options=pacsv.ParseOptions(newlines_in_values=False),
            convert_options=pacsv.ConvertOptions(
                column_types=types,
                include_columns=wanted,
                null_values=[""],  # what the careful path reads as "not measured"; no "NA"
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
            ),
        )
    except pa.ArrowException:
        return None
    n = table.num_rows
    if not n:
        return None
    table = table.unify_dictionaries()
    columns: dict[str, Any] = {}
    for c in wanted:
        column = table.column(c)
        if c in _NAMES:
            chunks = column.chunks
            dictionary = chunks[0].dictionary.to_pylist() if chunks else []
            codes = np.concatenate([ch.indices.to_numpy(zero_copy_only=False) for ch in chunks])
            columns[c] = _categories(codes, dictionary)
            continue
        if c in REQUIRED_COLUMNS and column.null_count:
            return None
        if c in _INTEGER:
            filled = column.fill_null(0) if column.null_count else column
            columns[c] = filled.to_numpy().astype(np.int64, copy=False)
        else:
            values = column.to_numpy().astype(np.float64, copy=False)
            if c in REQUIRED_COLUMNS and not np.isfinite(values).all():
                return None
            columns[c] = values
    return _build(columns, n)


def _build(columns: dict[str, Any], n: int) -> Trace:
    def number(key: str, integer: bool) -> np.ndarray:
        if key in columns:
            value: np.ndarray = columns[key]
            return value
        return np.zeros(n, dtype=np.int64) if integer else np.full(n, np.nan)

    no_group = (np.zeros(n, dtype=np.int64), [""])
    job_code, job_names = columns["job_id"]
    node_code, node_names = columns["node"]
    group_code, group_names = columns.get("group", no_group)
    return Trace(
        job_code=job_code,
        job_names=job_names,
        node_code=node_code,
        node_names=node_names,
        group_code=group_code,
        group_names=group_names,
        rank=number("rank", True),
        gpu=number("gpu", True),
        step=number("step", True),
        ts=number("ts", False),
        step_s=number("step_s", False),
        compute_s=number("compute_s", False),
        comm_s=number("comm_s", False),
        data_s=number("data_s", False),
    )


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


def _careful(text: str, header: list[str], name: str) -> Trace:
    reader = csv.reader(io.StringIO(text))
    try:
        next(reader, None)
        rows = [row for row in reader if row]
    except csv.Error as exc:
        raise TraceError(f"{name}: row {reader.line_num}: not CSV: {exc}") from None
    if not rows:
        raise TraceError(f"{name}: no records after the header")
    width = len(header)
    for i, row in enumerate(rows, start=2):
        if len(row) != width:
            raise TraceError(f"{name}: row {i} has {len(row)} fields, the header {width}")
    cells = dict(zip(header, (list(c) for c in zip(*rows, strict=True)), strict=True))
    columns: dict[str, Any] = {}
    for key in (c for c in TRACE_COLUMNS if c in cells):
        if key in _NAMES:
            seen: dict[str, int] = {}
            codes = np.fromiter(
                (seen.setdefault(v, len(seen)) for v in cells[key]), np.int64, len(rows)
            )
            columns[key] = _categories(codes, list(seen))
            continue
        try:
            columns[key] = _numbers(
                cells[key], key, integer=key in _INTEGER, optional=key in OPTIONAL_COLUMNS
            )
        except TraceError as exc:
            raise TraceError(f"{name}: {exc}") from None
    return _build(columns, len(rows))
