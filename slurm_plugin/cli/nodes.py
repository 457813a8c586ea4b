"""``straggler nodes`` and ``straggler node``: node histories, forgive and mark. A mark to or
from persistent queues the site's node hook (``store/hooks.py``), as the service's own do."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import click

from slurm_plugin.cli.common import actor, audit_action, done, json_option, slurm_node
from slurm_plugin.cli.output import emit_json, emit_rows, typed
from slurm_plugin.config import Settings
from slurm_plugin.policy.history import HistoryParams, NodeHistory
from slurm_plugin.service.executor import Executor
from slurm_plugin.service.factory import build
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.store import hooks


def _node_row(h: NodeHistory, now: float, params: HistoryParams) -> dict[str, Any]:
    return {
        "node": h.node,
        "state": h.state,
        "incidents": len(h.incidents),
        "jobs": len({i.job_id for i in h.incidents}),
        "decayed_incidents": round(h.decayed_incidents(now, params), 2),
        "last_incident": time.strftime("%Y-%m-%d %H:%M", time.gmtime(h.last_incident))
        if h.last_incident
        else "-",
    }


@click.command("nodes")
@click.option("--state", "wanted", type=click.Choice(["ok", "suspect", "persistent"]))
@json_option
@click.pass_obj
def nodes(settings: Settings, wanted: str | None, as_json: bool) -> None:
    """Nodes with a straggler history."""
    _, state, _ = build(settings)
    now = time.time()
    params = settings.persistence.params()
    rows = [_node_row(h, now, params) for h in state.nodes() if wanted in (None, h.state)]
    emit_rows(
        rows,
        ["node", "state", "incidents", "jobs", "decayed_incidents", "last_incident"],
        as_json=as_json,
    )


@click.group("node")
def node() -> None:
    """One node's history."""


@node.command("show")
@click.argument("name")
@json_option
@click.pass_obj
def node_show(settings: Settings, name: str, as_json: bool) -> None:
    """A node's incidents and Slurm state, as JSON (always; --json is accepted)."""
    scheduler, state, _ = build(settings)
    slurm = slurm_node(scheduler, name)
    history = json.loads(json.dumps(state.node_history(name), default=lambda o: o.__dict__))
    history["incidents"] = [typed(i) for i in history.get("incidents", [])]
    emit_json({"history": typed(history), "slurm": typed(dataclasses.asdict(slurm))})


@node.command("forgive")
@click.argument("name")
@json_option
@click.pass_obj
def node_forgive(settings: Settings, name: str, as_json: bool) -> None:
    """Clear a node's history and resume it if (and only if) we drained it."""
    scheduler, state, _ = build(settings)
    slurm = slurm_node(scheduler, name)  # Slurm first: unknown or unreachable changes nothing
    old = state.node_history(name)
    state.save_node_history(NodeHistory(name, forgiven=old.forgiven + 1))
    state.withdraw_refusal(name)
    decision_id = audit_action(state, "forgive", node=name, was=old.state)
    if old.state == "persistent":
        _hook(state, hooks.FORGIVEN, old, decision_id, "persistent")
    resumed = False
    if slurm is not None and not slurm.usable:
        resumed = Executor(scheduler, state, deployment=settings.deployment).resume_ours(
            name, slurm.reason, marks.new_decision_id()
        )
    note = (
        "resumed"
        if resumed
        else (
            f"left as is (drained by someone else: {slurm.reason!r})"
            if slurm and not slurm.usable
            else "not drained"
        )
    )
    done(as_json, f"{name}: history cleared; {note}", node=name, resumed=resumed, was=old.state)


@node.command("mark")
@click.argument("name")
@click.option(
    "--state",
    "new_state",
    type=click.Choice(["ok", "suspect", "persistent"]),
    required=True,
    help="The state to record (persistent nodes fail the prolog).",
)
@json_option
@click.pass_obj
def node_mark(settings: Settings, name: str, new_state: str, as_json: bool) -> None:
    """Set a node's straggler state by hand (recorded in the audit)."""
    scheduler, state, _ = build(settings)
    slurm_node(scheduler, name)  # Slurm first: an unknown node gets no ghost history
    old = state.node_history(name)
    now = time.time()
    state.save_node_history(
        dataclasses.replace(
            old,
            state=new_state,  # type: ignore[arg-type]
            persistent_since=now if new_state == "persistent" else None,
            last_incident=old.last_incident or now,
        )
    )
    decision_id = marks.new_decision_id()
    if new_state == "persistent":  # an admin's explicit word: prologs refuse the node
        state.refuse(name, decision_id, f"{marks.PREFIX} marked persistent by an admin")
    else:
        state.withdraw_refusal(name)
    state.save_decision(
        decision_id,
        {
            "state": "recorded",
            "action": "mark",
            "node": name,
            "was": old.state,
            "now": new_state,
            "by": actor(),
        },
    )
    if (new_state == "persistent") != (old.state == "persistent"):
        kind = hooks.PERSISTENT if new_state == "persistent" else hooks.FORGIVEN
        _hook(state, kind, old, decision_id, old.state)
    message = f"{name}: {old.state} -> {new_state}"
    done(as_json, message, node=name, was=old.state, now=new_state, decision_id=decision_id)


def _hook(state: ServiceState, kind: str, old: NodeHistory, decision_id: str, was: str) -> None:
    """Queue the site's hook for an admin's turn of a node (run by the leading service)."""
    hooks.push_turn(
        state.client,
        kind,
        old,
        decision_id,
        ts=time.time(),
        by=actor(),
        was=was,
        reasons=[f"{'marked' if kind == hooks.PERSISTENT else 'forgiven'} by an admin"],
    )
