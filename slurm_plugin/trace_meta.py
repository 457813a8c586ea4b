"""What a trace's decisions need beyond its steps: its jobs' time limits and checkpoints.

Two optional companions sit beside ``TRACE.csv`` (``straggler export`` writes both):

- ``TRACE.jobs.csv``: ``job_id,start_ts,end_limit_ts`` (unix seconds; an empty
  ``end_limit_ts`` is a job without a time limit);
- ``TRACE.events.csv``: ``job_id,ts,name``, names as the reporter's events
  (``checkpoint_end`` is the one decisions use).

Without them the backtest assumes what the service would not know either: the job started at
its first record, has no time limit (``assume_remaining_s``) and reports no checkpoints.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from slurm_plugin.errors import TraceError

JOBS_COLUMNS = ("job_id", "start_ts", "end_limit_ts")
EVENTS_COLUMNS = ("job_id", "ts", "name")
CHECKPOINT_END = "checkpoint_end"


@dataclass(frozen=True)
class JobFacts:
    """A job's facts that a trace's steps do not carry."""

    start_ts: float | None = None
    #: When its time limit ends (None: no limit).
    end_limit_ts: float | None = None


@dataclass
class TraceContext:
    """The companions of one trace (empty: none were found)."""

    jobs: dict[str, JobFacts] = field(default_factory=dict)
    #: Per job, its events as (ts, name) in ts order.
    events: dict[str, list[tuple[float, str]]] = field(default_factory=dict)

    def checkpoints(self, job_id: str) -> list[float]:
        """When the job's checkpoints ended, in ts order."""
        return [ts for ts, name in self.events.get(job_id, []) if name == CHECKPOINT_END]

    def describe(self) -> list[str]:
        """The assumptions the replay makes for what the companions do not say."""
        notes = []
        if not self.jobs:
            notes.append(
                "no TRACE.jobs.csv: each job taken to start at its first record, without a "
                "time limit (the policy's assume_remaining_s remains)"
            )
        if not any(self.checkpoints(j) for j in self.events):
            notes.append(
                "no checkpoint_end in TRACE.events.csv: no job taken to report checkpoints "
                "(a requeue loses the work since the job's start)"
            )
        return notes


def merge_contexts(contexts: list[TraceContext]) -> TraceContext:
    """One context of several traces' (a job in several keeps its last facts, and all its
    events in ts order)."""
    merged = TraceContext()
    for context in contexts:
        merged.jobs.update(context.jobs)
        for job, events in context.events.items():
            merged.events.setdefault(job, []).extend(events)
    for events in merged.events.values():
        events.sort()
    return merged


def companion(trace_path: Path, kind: str) -> Path:
    """``TRACE.<kind>.csv`` beside ``TRACE.csv``."""
    return trace_path.with_name(f"{trace_path.stem}.{kind}.csv")


#: The latest time a companion may give (unix seconds; year 5138): a larger one is a unit or
#: a corruption (1e308 made a decision "save" 10^300 seconds).
MAX_TS = 1e11


def _rows(path: Path, columns: tuple[str, ...]) -> Iterable[tuple[int, dict[str, str]]]:
    """The rows of a companion by line number; :class:`TraceError` (one line, naming the
    file and line) for text that is not UTF-8 or not CSV. A byte-order mark is read past."""
    line = 1
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            header = [h.strip() for h in reader.fieldnames or []]
            missing = [c for c in columns if c not in header]
            if missing:
                raise TraceError(
                    f"{path.name}: missing column(s) {', '.join(missing)}; "
                    f"the header must be {','.join(columns)}"
                )
            reader.fieldnames = header
            for line, row in enumerate(reader, start=2):
                yield line, row
    except UnicodeDecodeError as exc:
        raise TraceError(
            f"{path.name}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} near line "
            f"{line + 1}); save it as UTF-8"
        ) from None
    except csv.Error as exc:
        raise TraceError(f"{path.name}: line {line + 1}: not CSV: {exc}") from None


def _number(path: Path, line: int, column: str, text: str | None, *, optional: bool) -> float:
    """A time column's value: unix seconds, 0 to ``MAX_TS``."""
    text = (text or "").strip()
    if not text and optional:
        return math.nan
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise TraceError(f"{path.name}: line {line}, {column}: not a finite number: {text[:40]!r}")
    if not 0 <= value <= MAX_TS:
        raise TraceError(
            f"{path.name}: line {line}, {column}: {text[:40]} is not a unix time in seconds "
            f"(0 to {MAX_TS:.0e})"
        )
    return value


def read_context(trace_path: Path) -> TraceContext:
    """The companions found beside ``trace_path`` (an empty context when there are none)."""
    context = TraceContext()
    jobs = companion(trace_path, "jobs")
    if jobs.is_file():
        for line, row in _rows(jobs, JOBS_COLUMNS):
            start = _number(jobs, line, "start_ts", row["start_ts"], optional=True)
            limit = _number(jobs, line, "end_limit_ts", row["end_limit_ts"], optional=True)
            context.jobs[row["job_id"].strip()] = JobFacts(
                None if math.isnan(start) else start, None if math.isnan(limit) else limit
            )
    events = companion(trace_path, "events")
    if events.is_file():
        for line, row in _rows(events, EVENTS_COLUMNS):
            ts = _number(events, line, "ts", row["ts"], optional=False)
            name = (row["name"] or "").strip()
            context.events.setdefault(row["job_id"].strip(), []).append((ts, name))
        for listed in context.events.values():
            listed.sort()
    return context


def write_jobs(rows: Iterable[tuple[str, JobFacts]], out: TextIO) -> int:
    """Write ``TRACE.jobs.csv``; returns the number of jobs."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(JOBS_COLUMNS)
    n = 0
    for job_id, facts in rows:
        writer.writerow(
            [
                job_id,
                "" if facts.start_ts is None else f"{facts.start_ts:.3f}",
                "" if facts.end_limit_ts is None else f"{facts.end_limit_ts:.3f}",
            ]
        )
        n += 1
    return n


def write_events(rows: Iterable[tuple[str, float, str]], out: TextIO) -> int:
    """Write ``TRACE.events.csv``; returns the number of events."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(EVENTS_COLUMNS)
    n = 0
    for job_id, ts, name in rows:
        writer.writerow([job_id, f"{ts:.6f}", name])
        n += 1
    return n
