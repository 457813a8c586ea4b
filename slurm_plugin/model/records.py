"""Telemetry records and their stream encoding (pure; no Redis here).

A steps-stream entry holds one rank's flush: ``rank``, ``node``, ``gpu``, ``attempt``, ``n`` and
``steps``, where ``steps`` packs ``n`` lines of ``step ts step_s compute_s comm_s data_s`` (``-``
for a phase that was not measured). Packing a second of steps into one entry cuts Redis work by
the steps-per-second factor compared with one entry per step.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slurm_plugin.errors import TelemetryError

MAX_STEPS_PER_ENTRY = 10_000
#: Ranks, GPUs and attempts above this are refused (they go into 64-bit columns; a number a job
#: wrote with 30 digits must be one entry refused, not a cycle that fails for every job).
MAX_HEADER_NUMBER = (1 << 31) - 1
_MISSING = "-"
_GROUP = re.compile(r"[A-Za-z0-9_.:=/+-]{1,64}")
_FLUSH = re.compile(r"([0-9a-f]{16})\.([0-9]{1,18})")
# A steps text: lines of an integer step and five numbers (or "-"), one space apart. Tokens use
# only what the encoder writes (digits, ".", "e", "+", "-"): never "nan" or "inf".
_LINE = r"[0-9]{1,15}(?: [-+.e0-9]{1,32}){5}"  # steps below 2**53
STEPS_TEXT = re.compile(f"{_LINE}(?:\n{_LINE})*")

# One raw step as the reporter buffers it: (step, ts, step_s, compute_s, comm_s, data_s).
RawStep = tuple[int, float, float, float | None, float | None, float | None]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One rank's timings for one training step (seconds; ts is unix time at step end)."""

    job_id: str
    rank: int
    node: str
    gpu: int
    step: int
    ts: float
    step_s: float
    compute_s: float | None = None
    comm_s: float | None = None
    data_s: float | None = None
    attempt: int = 0
    #: The rank's peer group (ranks doing the same work, e.g. a pipeline stage); "" = none.
    group: str = ""


def is_valid_duration(value: float | None) -> bool:
    """A phase duration is acceptable when missing, or finite and non-negative."""
    return value is None or (isinstance(value, int | float) and math.isfinite(value) and value >= 0)


def is_valid_raw(raw: RawStep) -> bool:
    """True when a buffered step can be published (finite, non-negative, step >= 0)."""
    step, ts, step_s, compute_s, comm_s, data_s = raw
    return (
        isinstance(step, int)
        and step >= 0
        and isinstance(ts, float)
        and math.isfinite(ts)
        and step_s is not None
        and is_valid_duration(step_s)
        and is_valid_duration(compute_s)
        and is_valid_duration(comm_s)
        and is_valid_duration(data_s)
    )


def normalise_raw(raw: tuple[Any, ...]) -> RawStep | None:
    """A step as the training thread recorded it, coerced (numpy scalars, ints) and
    checked; None when unusable."""
    try:
        step = int(raw[0])
        if step != raw[0]:
            return None
        values = (
            float(raw[1]),
            float(raw[2]),
            *(None if v is None else float(v) for v in raw[3:6]),
        )
    except (TypeError, ValueError, OverflowError):
        return None
    candidate: RawStep = (step, *values)  # type: ignore[assignment]
    return candidate if is_valid_raw(candidate) else None


def _fmt(value: float | None) -> str:
    return _MISSING if value is None else f"{value:.9g}"


def encode_steps(
    rank: int,
    node: str,
    gpu: int,
    attempt: int,
    raws: Sequence[RawStep],
    group: str = "",
    *,
    flush: str = "",
) -> dict[str, str]:
    """The stream fields for one rank's batch of (already validated) steps; ``group`` (the
    rank's peer group) and ``flush`` (the entry's id from its reporter: session.sequence)
    only when there is one."""
    lines = "\n".join(
        f"{s} {ts:.6f} {_fmt(a)} {_fmt(b)} {_fmt(c)} {_fmt(d)}" for s, ts, a, b, c, d in raws
    )
    fields = {
        "rank": str(rank),
        "node": node,
        "gpu": str(gpu),
        "attempt": str(attempt),
        "n": str(len(raws)),
        "steps": lines,
    }
    if group:
        fields["group"] = check_group(group)
    if flush:
        fields["flush"] = flush
    return fields


def flush_id(fields: Mapping[str, str]) -> tuple[str, int] | None:
    """An entry's (session, sequence) from its ``flush`` field; None when it has none or a
    malformed one (such an entry is never taken for a repeat)."""
    match = _FLUSH.fullmatch(fields.get("flush", ""))
    return (match[1], int(match[2])) if match else None


def check_group(group: str) -> str:
    """A peer-group label: at most 64 printable characters without spaces or commas (it is a
    CSV column and a label in logs); raises :class:`TelemetryError` otherwise."""
    if not _GROUP.fullmatch(group):
        raise TelemetryError(f"group label must match {_GROUP.pattern}: {group[:40]!r}")
    return group


def _field(fields: Mapping[str, str], name: str) -> str:
    try:
        return fields[name]
    except KeyError:
        raise TelemetryError(f"steps entry lacks field {name!r}") from None


def non_negative_int(text: str, name: str) -> int:
    """``text`` as an integer >= 0; :class:`TelemetryError` naming ``name`` (a record field, an
    environment variable) otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise TelemetryError(f"{name}={text[:20]!r} is not an integer") from None
    if value < 0:
        raise TelemetryError(f"{name}={value} is negative")
    return value


def _header_number(text: str, name: str) -> int:
    """A rank, GPU or attempt: :func:`non_negative_int` up to ``MAX_HEADER_NUMBER``."""
    value = non_negative_int(text, name)
    if value > MAX_HEADER_NUMBER:
        raise TelemetryError(f"{name}={text[:20]!r} is out of range")
    return value


def _float(text: str, name: str, *, optional: bool) -> float | None:
    if text == _MISSING and optional:
        return None
    try:
        value = float(text)
    except ValueError:
        raise TelemetryError(f"{name} is not a number: {text[:20]!r}") from None
    if not math.isfinite(value) or value < 0:
        raise TelemetryError(f"{name} must be finite and non-negative, not {text[:20]!r}")
    return value


@dataclass(slots=True)
class FlushHeader:
    """What a steps entry (one rank's flush) says once for all its steps (not frozen: the
    service builds ~32,000 a cycle at 2,000 jobs, and a frozen dataclass costs four times as
    much to build; nothing changes one after :func:`decode_header`)."""

    rank: int
    node: str
    gpu: int
    attempt: int
    group: str
    count: int
    #: The steps: ``count`` lines of six tokens; "" when none.
    text: str
    #: The text is made of the tokens the encoder writes (STEPS_TEXT); when not, decoding
    #: names the bad value or refuses the text.
    regular: bool = True


def decode_header(fields: Mapping[str, str]) -> FlushHeader:
    """A flush's header and its steps text, checked; :class:`TelemetryError` naming the bad
    field otherwise (the steps' values are checked by whoever decodes them)."""
    get = fields.get
    rank_text, gpu_text, attempt_text = get("rank", ""), get("gpu", ""), get("attempt", "0")
    count_text, node, text = get("n", ""), get("node"), get("steps")
    # The usual entry, at ~32,000 a cycle: numbers of decimal digits only (which int() takes
    # and which are never negative), a node, no group, a regular text of as many lines as it
    # says; anything else goes through the checks that name what is wrong.
    try:  # one test of the four numbers' digits; each must have some (int("") raises)
        if (rank_text + gpu_text + attempt_text + count_text).isdecimal() and not get("group"):
            count = int(count_text)
            if (
                0 < count <= MAX_STEPS_PER_ENTRY
                and isinstance(node, str)
                and isinstance(text, str)
                and text.count("\n") + 1 == count
                and STEPS_TEXT.fullmatch(text)
            ):
                rank, gpu, attempt = int(rank_text), int(gpu_text), int(attempt_text)
                if max(rank, gpu, attempt) <= MAX_HEADER_NUMBER:
                    return FlushHeader(rank, node, gpu, attempt, "", count, text)
    except (TypeError, ValueError):  # a field that is not text, or an empty number
        pass
    return _checked_header(fields)


def _checked_header(fields: Mapping[str, str]) -> FlushHeader:
    """:func:`decode_header` of an entry off the usual path, every field checked."""
    rank = _header_number(_field(fields, "rank"), "rank")
    gpu = _header_number(_field(fields, "gpu"), "gpu")
    attempt = _header_number(fields.get("attempt", "0"), "attempt")
    node = _field(fields, "node")
    group = check_group(fields["group"]) if fields.get("group") else ""
    count = non_negative_int(_field(fields, "n"), "n")
    if count > MAX_STEPS_PER_ENTRY:
        raise TelemetryError(f"entry claims {count} steps (max {MAX_STEPS_PER_ENTRY})")
    text = _field(fields, "steps") if count else ""
    regular = not count or bool(STEPS_TEXT.fullmatch(text))
    lines = text.count("\n") + 1 if count else 0
    if lines != count:
        raise TelemetryError(f"entry says n={count} but holds {lines} steps")
    if not regular:
        bad = next((line for line in text.split("\n") if len(line.split(" ")) != 6), None)
        if bad is not None:
            raise TelemetryError(f"step line has {len(bad.split(' '))} fields, not 6: {bad[:60]!r}")
    return FlushHeader(rank, node, gpu, attempt, group, count, text, regular)


def _values(head: FlushHeader) -> list[RawStep]:
    """The steps of a checked header, every value checked; :class:`TelemetryError` naming the
    first bad one."""
    rows: list[RawStep] = []
    for line in head.text.split("\n") if head.count else []:
        parts = line.split(" ")
        ts = _float(parts[1], "ts", optional=False)
        step_s = _float(parts[2], "step_s", optional=False)
        if ts is None or step_s is None:  # cannot happen with optional=False; for the types
            raise TelemetryError("ts and step_s are required")
        rows.append(
            (
                non_negative_int(parts[0], "step"),
                ts,
                step_s,
                _float(parts[3], "compute_s", optional=True),
                _float(parts[4], "comm_s", optional=True),
                _float(parts[5], "data_s", optional=True),
            )
        )
    if not head.regular:  # every value parsed, but not as the encoder writes them ("1_0")
        raise TelemetryError(f"steps hold a token out of place: {head.text[:60]!r}")
    return rows


def check_steps(fields: Mapping[str, str]) -> FlushHeader:
    """Check one steps-stream entry whole (header and every value) without building records;
    its header. :class:`TelemetryError` naming the bad field."""
    head = decode_header(fields)
    _values(head)
    return head


def decode_steps(job_id: str, fields: Mapping[str, str]) -> list[StepRecord]:
    """Decode one steps-stream entry; raise :class:`TelemetryError` naming the bad field."""
    head = decode_header(fields)
    return [
        StepRecord(
            job_id=job_id,
            rank=head.rank,
            node=head.node,
            gpu=head.gpu,
            step=step,
            ts=ts,
            step_s=step_s,
            compute_s=compute_s,
            comm_s=comm_s,
            data_s=data_s,
            attempt=head.attempt,
            group=head.group,
        )
        for step, ts, step_s, compute_s, comm_s, data_s in _values(head)
    ]


#: The largest JSON record (an event, a GPU sample) taken: a job's own fields, never a dump.
MAX_JSON_ENTRY_BYTES = 16384


def encode_json_entry(payload: Mapping[str, Any]) -> dict[str, str]:
    """Stream fields for a low-rate JSON record (events, GPU samples); :class:`TelemetryError`
    when a value is not finite (a diverged loss) or the record is over the size bound."""
    try:
        text = json.dumps(payload, separators=(",", ":"), allow_nan=False, default=str)
    except (ValueError, TypeError, RecursionError) as exc:
        raise TelemetryError(f"record is not plain JSON with finite numbers: {exc}") from None
    if len(text) > MAX_JSON_ENTRY_BYTES:
        raise TelemetryError(f"record of {len(text)} bytes, over {MAX_JSON_ENTRY_BYTES}")
    return {"json": text}


def _no_constant(name: str) -> Any:
    raise TelemetryError(f"entry holds {name}, not a finite number")


def _json_int(text: str) -> int:
    """An integer of a JSON entry: at most 18 digits (a larger one is no step, time or count
    a job reports, and 10**400 raised OverflowError where the service took it for a time)."""
    if len(text.lstrip("-")) > 18:
        raise TelemetryError(f"entry holds an integer of {len(text)} characters")
    return int(text)


def _json_float(text: str) -> float:
    """A float of a JSON entry, finite (1e400 reads as infinity)."""
    value = float(text)
    if not math.isfinite(value):
        raise TelemetryError(f"entry holds {text[:20]}, not a finite number")
    return value


def decode_json_entry(fields: Mapping[str, str]) -> dict[str, Any]:
    """Decode :func:`encode_json_entry`; raise :class:`TelemetryError` when malformed (NaN and
    the infinities included: Python's JSON reads them, our writers never write them; and an
    integer past 18 digits). Any entry a job writes decodes or raises this error alone: one
    that raised another (a 5,000-digit integer: ValueError) failed the service's whole cycle,
    and again each cycle, for every job."""
    try:
        value = json.loads(
            _field(fields, "json"),
            parse_constant=_no_constant,
            parse_int=_json_int,
            parse_float=_json_float,
        )
    except (ValueError, RecursionError, TypeError) as exc:
        raise TelemetryError(f"entry is not valid JSON: {exc}".splitlines()[0][:200]) from None
    if not isinstance(value, dict):
        raise TelemetryError("entry JSON is not an object")
    return value


def to_text(fields: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """Stream fields as returned by redis-py (bytes) to text; undecodable bytes are replaced."""
    return {
        (k.decode("utf-8", "replace") if isinstance(k, bytes) else k): (
            v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        )
        for k, v in fields.items()
    }


def sort_records(records: Iterable[StepRecord]) -> list[StepRecord]:
    """Records in trace order: by timestamp, then rank, then step."""
    return sorted(records, key=lambda r: (r.ts, r.rank, r.step))
