"""What the admin commands share: durations, who acts, the audit of admin actions, asking
Slurm about a node, and how a command reports what it did."""

from __future__ import annotations

import getpass
import os
import re
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import click

from slurm_plugin.cli.output import emit_json, printable
from slurm_plugin.errors import StragglerError
from slurm_plugin.model.cluster import NodeInfo
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.slurm.scheduler import Scheduler

F = TypeVar("F", bound=Callable[..., Any])


def json_option(command: F) -> F:
    """``--json`` for every command: typed JSON on stdout instead of text."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")(command)


def done(as_json: bool, message: str, **fields: Any) -> None:
    """Report what a command did: one line of text, or JSON with the same facts."""
    if as_json:
        emit_json({"message": message, **fields})
    else:
        click.echo(message)


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")


#: The longest duration any command takes (--for, --since): ten years.
MAX_DURATION_S = 3650 * 86400.0


def parse_duration(text: str) -> float:
    """``90``, ``30s``, ``30m``, ``2h``, ``1d`` -> seconds; more than 0, at most ten years."""
    match = _DURATION.match(text.strip())
    if not match:
        raise click.BadParameter(f"{text[:40]!r} is not a duration like 30m, 2h, 1d")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    seconds = float(match.group(1)) * unit
    if not 0 < seconds <= MAX_DURATION_S:
        raise click.BadParameter(f"{text[:40]!r}: a duration is more than 0 and at most 3650d")
    return seconds


def this_node() -> str:
    """The node a command runs on: Slurm's name for it inside a job, else the short host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def actor() -> str:
    """Who runs this command: the login behind sudo when there is one."""
    return os.environ.get("SUDO_USER") or getpass.getuser()


def audit_action(state: ServiceState, action: str, **fields: Any) -> str:
    """Record an admin action in the audit trail, with who did it; returns its id."""
    decision_id = marks.new_decision_id()
    state.save_decision(
        decision_id, {"state": "recorded", "action": action, "by": actor(), **fields}
    )
    return decision_id


def slurm_node(scheduler: Scheduler, name: str) -> NodeInfo:
    """The node as Slurm knows it; an error when Slurm does not (never a ghost node)."""
    found = next((n for n in scheduler.nodes() if n.name == name), None)
    if found is None:
        raise StragglerError(f"Slurm knows no node {printable(name[:64])!r} (hint: sinfo -N)")
    return found


def span(seconds: float) -> str:
    """1799.6 -> '29m 60s' style, coarse: '29m 59s', '2h 5m', '3d 1h'."""
    s = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if s >= size:
            return f"{s // size}{unit} {s % size // sub_size}{sub}"
    return f"{s // 60}m {s % 60}s" if s >= 60 else f"{s}s"
