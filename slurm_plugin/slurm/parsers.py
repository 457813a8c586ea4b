"""Pure parsers for Slurm's text output (golden-tested; no subprocess here)."""

from __future__ import annotations

import json
import re
from typing import Any

import hostlist

from slurm_plugin.errors import SlurmError
from slurm_plugin.slurm.model import JobInfo, NodeInfo

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


def _load(text: str, key: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmError(f"not JSON: {exc}") from None
    items = data.get(key) if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise SlurmError(f"JSON without a {key!r} list")
    return [i for i in items if isinstance(i, dict)]


def _number(value: Any) -> float | None:
    # Slurm 22.05 gives plain numbers; later versions {"set": true, "number": N}.
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _text(value: Any) -> str:
    if isinstance(value, list):  # newer Slurm: job_state is a list of flags
        return str(value[0]) if value else ""
    return "" if value is None else str(value)


def _job(item: dict[str, Any]) -> JobInfo:
    raw_id = item.get("job_id")
    if isinstance(raw_id, bool) or not isinstance(raw_id, int) or raw_id < 0:
        raise SlurmError(f"job without a valid job_id: {str(item)[:80]}")
    job_id = str(raw_id)
    limit = _number(item.get("time_limit"))
    start = _number(item.get("start_time"))
    return JobInfo(
        job_id=job_id,
        name=_text(item.get("name")),
        state=_text(item.get("job_state")),
        reason=_text(item.get("state_reason")),
        nodes=tuple(expand_hostlist(_text(item.get("nodes")))),
        excluded=tuple(expand_hostlist(_text(item.get("excluded_nodes")))),
        restarts=int(_number(item.get("restart_cnt")) or 0),
        requeue=bool(item.get("requeue", False)),
        comment=_text(item.get("comment")),
        admin_comment=_text(item.get("admin_comment")),
        partition=_text(item.get("partition")),
        node_count=int(_number(item.get("node_count")) or 0),
        user=_text(item.get("user_name")),
        time_limit_s=None if limit is None else limit * 60.0,  # minutes in squeue JSON
        start_time=start if start else None,
        priority=None
        if _number(item.get("priority")) is None
        else int(_number(item.get("priority")) or 0),
    )


def parse_squeue_json(text: str) -> list[JobInfo]:
    """Jobs from ``squeue --json`` (which ignores filters in 22.05: filter in code)."""
    return [_job(item) for item in _load(text, "jobs")]


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    """Nodes from ``sinfo --json`` (one entry per node)."""
    nodes = []
    for item in _load(text, "nodes"):
        name = _text(item.get("name"))
        if not name:
            raise SlurmError("node without a name")
        state = item.get("state")
        flags = item.get("state_flags") or []
        if isinstance(state, list):  # newer Slurm: state is a list of base state and flags
            flags = [*state[1:], *flags]
            state = state[0] if state else ""
        nodes.append(
            NodeInfo(
                name=name,
                state=_text(state).lower(),
                flags=tuple(str(f) for f in flags),
                reason=_text(item.get("reason")),
                partitions=tuple(str(p) for p in item.get("partitions") or []),
            )
        )
    return nodes


def parse_scontrol_job(line: str) -> JobInfo:
    """One job from ``scontrol -o show job J``. Comment fields may hold anything, so prefer
    ``squeue --json`` for them; this is for the fields only scontrol shows promptly."""
    record = parse_scontrol_record(line)
    if "JobId" not in record:
        raise SlurmError(f"scontrol output without a JobId: {line[:80]!r}")
    job_id = str(_count(record, "JobId"))
    return JobInfo(
        job_id=job_id,
        name=record.get("JobName", ""),
        state=record.get("JobState", ""),
        reason=record.get("Reason", ""),
        nodes=tuple(expand_hostlist(record.get("NodeList", ""))),
        excluded=tuple(expand_hostlist(record.get("ExcNodeList", ""))),
        restarts=_count(record, "Restarts"),
        requeue=record.get("Requeue") == "1",
        comment=record.get("Comment", ""),
        admin_comment=record.get("AdminComment", ""),
        partition=record.get("Partition", ""),
        node_count=_count(record, "NumNodes"),
        user=record.get("UserId", "").split("(")[0],
        priority=int(record["Priority"]) if record.get("Priority", "").isdigit() else None,
    )


def _count(record: dict[str, str], key: str) -> int:
    """A non-negative count field (``NumNodes=2-4`` gives its minimum); SlurmError names it."""
    value = record.get(key, "0")
    text = (value.split("-", 1)[0] or "0") if key != "JobId" else value
    if not text.isdigit() or not text.isascii():
        raise SlurmError(f"scontrol field {key}={record.get(key, '')[:20]!r} is not a count")
    return int(text)
