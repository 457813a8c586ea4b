"""Pure parsers for Slurm's text output (golden-tested; no subprocess here)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from typing import Any

import hostlist

from slurm_plugin.errors import SlurmError
from slurm_plugin.model.cluster import JobInfo, NodeInfo, valid_sluid

# As far as text can tell, a new field starts at a space followed by ``Key=`` where Key is a
# Slurm field name. Values may contain spaces (Command=, Comment=, Reason=), so splitting on
# every space would be wrong.
_FIELD_START = re.compile(r"(?:^|\s)(?=[A-Z][A-Za-z0-9_:/]*=)")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """Parse one ``scontrol -o show job|node`` line into ``{Key: value}``, for display and
    diagnostics only: the text format cannot be split unambiguously (a job's name, comment or
    submit line may hold ``Key=Value`` text), so nothing the service trusts comes from here."""
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


def field_values(line: str, key: str) -> list[str]:
    """Every value a ``scontrol -o`` line gives ``key``, in order: Slurm's own and any that
    text of the job (its name, comment, submit line) makes look like one."""
    values = []
    for chunk in _FIELD_START.split(line.strip()):
        name, sep, value = chunk.partition("=")
        if sep and name == key:
            values.append(value.strip())
    return values


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


def _document(text: str) -> dict[str, Any]:
    """A Slurm JSON answer. One that carries ``errors`` (22.05's squeue exits 0 with an error and
    no jobs when slurmctld is away) is an error, never an empty list."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SlurmError("Slurm's JSON answer is not an object")
    errors = data.get("errors")
    if errors:
        first = errors[0] if isinstance(errors, list) else errors
        if isinstance(first, dict):
            first = first.get("description") or first.get("error") or first
        raise SlurmError(f"Slurm answered with errors: {str(first)[:160]}")
    return data


def _items(data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = data.get(key)
    if not isinstance(items, list):
        raise SlurmError(f"JSON without a {key!r} list")
    return [i for i in items if isinstance(i, dict)]


def _number(value: Any) -> float | None:
    # Slurm 22.05 gives plain numbers; later versions {"set": true, "number": N}.
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer past any float
        return None
    return number if math.isfinite(number) else None  # JSON's Infinity is no count


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
    submitted = _number(item.get("submit_time"))
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
        submit_time=submitted if submitted else None,
        sluid=_sluid(item),
    )


def _sluid(item: dict[str, Any]) -> str | None:
    """The run's SLUID: under ``step_id`` in 26.05's squeue JSON (the job's whole "step"),
    or at the top where a release puts it there; None before 25.11."""
    step = item.get("step_id")
    found = step.get("sluid") if isinstance(step, dict) else None
    return valid_sluid(found if found is not None else item.get("sluid"))


def parse_squeue_json(text: str) -> list[JobInfo]:
    """Jobs from ``squeue --json`` (which ignores filters in 22.05: filter in code)."""
    return [_job(item) for item in _items(_document(text), "jobs")]


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    """Nodes from ``sinfo --json``, one per node, of either shape: a ``"nodes"`` list (22.05) or,
    from 23.02 on, a ``"sinfo"`` list of node groups (one per partition and state, so a node in
    two partitions appears twice: its partitions are merged)."""
    data = _document(text)
    if "sinfo" not in data:
        return [_node_of_22_05(item) for item in _items(data, "nodes")]
    merged: dict[str, NodeInfo] = {}
    for group in _items(data, "sinfo"):
        for node in _nodes_of_group(group):
            seen = merged.get(node.name)
            both = node.partitions if seen is None else (*seen.partitions, *node.partitions)
            merged[node.name] = replace(seen or node, partitions=tuple(dict.fromkeys(both)))
    return list(merged.values())


def _state(state: Any, flags: Any) -> tuple[str, tuple[str, ...]]:
    """Base state (lower case) and flags; newer Slurm lists the flags after the base state."""
    extra = [str(f) for f in flags] if isinstance(flags, list) else []
    if isinstance(state, list):
        extra = [str(f) for f in state[1:]] + extra
        state = state[0] if state else ""
    return _text(state).lower(), tuple(extra)


def _node_of_22_05(item: dict[str, Any]) -> NodeInfo:
    name = _text(item.get("name"))
    if not name:
        raise SlurmError("node without a name")
    state, flags = _state(item.get("state"), item.get("state_flags"))
    partitions = item.get("partitions")
    return NodeInfo(
        name=name,
        state=state,
        flags=flags,
        reason=_text(item.get("reason")),
        partitions=tuple(str(p) for p in partitions) if isinstance(partitions, list) else (),
        reason_time=_number(item.get("reason_changed_at")) or None,
    )


def _nodes_of_group(group: dict[str, Any]) -> list[NodeInfo]:
    members = group.get("nodes")
    names = members.get("nodes") if isinstance(members, dict) else None
    hosts = (
        [h for entry in names for h in expand_hostlist(_text(entry))]
        if isinstance(names, list)
        else []
    )
    if not hosts:
        raise SlurmError(f"sinfo node group without node names: {str(group)[:80]}")
    node = group.get("node")
    state, flags = _state(node.get("state") if isinstance(node, dict) else None, None)
    reason = group.get("reason")
    reason_info = reason if isinstance(reason, dict) else {}
    partition = group.get("partition")
    partition_name = _text(partition.get("name")) if isinstance(partition, dict) else ""
    return [
        NodeInfo(
            name=host,
            state=state,
            flags=flags,
            reason=_text(reason_info.get("description") if reason_info else reason),
            partitions=(partition_name,) if partition_name else (),
            reason_time=_number(reason_info.get("time")) or None,
        )
        for host in hosts
    ]
