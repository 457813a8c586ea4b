"""Admin commands: serve, policies, nodes, jobs, pause/resume, audit, status."""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from slurm_plugin.cli.output import emit_json, emit_rows, emit_table, printable
from slurm_plugin.config import Settings
from slurm_plugin.errors import ConfigError, StragglerError
from slurm_plugin.policy.history import HistoryParams, NodeHistory
from slurm_plugin.policy.loader import active_policies, load_policy
from slurm_plugin.service.executor import Executor
from slurm_plugin.service.factory import build
from slurm_plugin.service.loop import Service
from slurm_plugin.service.metrics import Metrics
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.slurm.model import NodeInfo
from slurm_plugin.slurm.scheduler import Scheduler

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_AUDIT_ID = re.compile(r"\d{1,20}-\d{1,20}")


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


@click.command("serve")
@click.option("--once", is_flag=True, help="Run one cycle and exit.")
@click.option("--dry-run", is_flag=True, help="Detect and decide, but never act on Slurm.")
@click.pass_obj
def serve(settings: Settings, once: bool, dry_run: bool) -> None:
    """Run the policy service (leader-elected; a second instance waits as a standby). A fatal
    configuration (policies, Slurm commands, Redis) exits non-zero before taking the lock."""
    for name in ("scontrol", "squeue", "sinfo"):
        if shutil.which(settings.slurm_command(name)) is None:
            raise ConfigError(
                f"Slurm command {settings.slurm_command(name)!r} not found (hint: install the "
                "Slurm client commands or set slurm_bin_dir)",
                field="slurm_bin_dir",
            )
    scheduler, state, store = build(settings)
    state.r.ping()  # Redis unreachable: one line from the CLI, before anything else
    service = Service(
        settings, scheduler, state, store, dry_run=dry_run, metrics=Metrics(settings.metrics_port)
    )
    service.reload_policies()  # no policy directory or no valid default policy: exit here
    with contextlib.suppress(KeyboardInterrupt):
        report = service.run(once=once)
        if once and report.error:
            raise StragglerError(f"the cycle failed: {report.error}")


@click.group("policy")
def policy() -> None:
    """Inspect and validate policies."""


@policy.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def policy_list(settings: Settings, as_json: bool) -> None:
    """The active policies: the policy directory's, overridden by applied ones."""
    _, state, _ = build(settings)
    applied = state.applied_policies()
    policies, problems = active_policies(settings.policy_dir, applied)
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)
    rows = [
        {
            "name": p.name,
            "mode": p.actions.mode,
            "min_slowdown_pct": p.detection.min_slowdown_pct,
            "default": p.name == settings.default_policy,
            "source": "applied" if p.name in applied else "file",
            "description": p.description,
        }
        for p in policies.values()
    ]
    emit_rows(
        rows,
        ["name", "mode", "min_slowdown_pct", "default", "source", "description"],
        as_json=as_json,
    )


@policy.command("show")
@click.argument("name")
@click.pass_obj
def policy_show(settings: Settings, name: str) -> None:
    """One active policy with every field, as JSON."""
    _, state, _ = build(settings)
    policies, _problems = active_policies(settings.policy_dir, state.applied_policies())
    if name not in policies:
        raise StragglerError(f"no policy {name!r}; have {', '.join(sorted(policies))}")
    emit_json(policies[name].model_dump())


@policy.command("validate")
@click.argument("path", type=click.Path(path_type=Path, exists=True, dir_okay=False))
def policy_validate(path: Path) -> None:
    """Check a policy file; exit 2 with the field and file on error."""
    loaded = load_policy(path)
    click.echo(f"{path}: policy {loaded.name!r} is valid (mode {loaded.actions.mode})")


@policy.command("apply")
@click.argument("path", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.pass_obj
def policy_apply(settings: Settings, path: Path) -> None:
    """Validate a policy file and make it active (overrides the file of the same name)."""
    loaded = load_policy(path)
    _, state, _ = build(settings)
    state.apply_policy(loaded.name, loaded.model_dump_json())
    _audit(state, "policy_apply", policy=loaded.name)
    click.echo(f"applied policy {loaded.name!r}; the service uses it from its next cycle")


@policy.command("diff")
@click.argument("path", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.pass_obj
def policy_diff(settings: Settings, path: Path) -> None:
    """What a policy file would change against the active policy of the same name."""
    new = load_policy(path)
    _, state, _ = build(settings)
    policies, _problems = active_policies(settings.policy_dir, state.applied_policies())
    if new.name not in policies:
        click.echo(f"{new.name}: new policy")
        return
    current = policies[new.name].model_dump()
    changes = _diff(current, new.model_dump())
    for line in changes or ["no changes"]:
        click.echo(line)


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    lines = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            lines.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return lines


def _node_row(h: NodeHistory, now: float, params: HistoryParams) -> dict[str, Any]:
    return {
        "node": h.node,
        "state": h.state,
        "incidents": len(h.incidents),
        "jobs": len({i.job_id for i in h.incidents}),
        "score": round(h.score(now, params), 2),
        "last_incident": time.strftime("%Y-%m-%d %H:%M", time.gmtime(h.last_incident))
        if h.last_incident
        else "-",
    }


def actor() -> str:
    """Who runs this command: the login behind sudo when there is one."""
    return os.environ.get("SUDO_USER") or getpass.getuser()


def _audit(state: ServiceState, action: str, **fields: Any) -> None:
    """Record an admin action in the audit trail, with who did it."""
    state.save_decision(
        marks.new_decision_id(), {"state": "recorded", "action": action, "by": actor(), **fields}
    )


def _slurm_node(scheduler: Scheduler, name: str) -> NodeInfo:
    """The node as Slurm knows it; an error when Slurm does not (never a ghost node)."""
    found = next((n for n in scheduler.nodes() if n.name == name), None)
    if found is None:
        raise StragglerError(f"Slurm knows no node {printable(name[:64])!r} (hint: sinfo -N)")
    return found


@click.command("nodes")
@click.option("--state", "wanted", type=click.Choice(["ok", "suspect", "persistent"]))
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def nodes(settings: Settings, wanted: str | None, as_json: bool) -> None:
    """Nodes with a straggler history."""
    _, state, _ = build(settings)
    now = time.time()
    params = settings.persistence.params()
    rows = [_node_row(h, now, params) for h in state.nodes() if wanted in (None, h.state)]
    emit_rows(
        rows, ["node", "state", "incidents", "jobs", "score", "last_incident"], as_json=as_json
    )


@click.group("node")
def node() -> None:
    """One node's history."""


@node.command("show")
@click.argument("name")
@click.pass_obj
def node_show(settings: Settings, name: str) -> None:
    """A node's incidents and Slurm state, as JSON."""
    scheduler, state, _ = build(settings)
    history = state.node_history(name)
    slurm = next((n for n in scheduler.nodes() if n.name == name), None)
    emit_json(
        {
            "history": json.loads(json.dumps(history, default=lambda o: o.__dict__)),
            "slurm": slurm.__dict__ if slurm else None,
        }
    )


@node.command("forgive")
@click.argument("name")
@click.pass_obj
def node_forgive(settings: Settings, name: str) -> None:
    """Clear a node's history and resume it if (and only if) we drained it."""
    scheduler, state, _ = build(settings)
    slurm = _slurm_node(scheduler, name)  # Slurm first: unknown or unreachable changes nothing
    old = state.node_history(name)
    state.save_node_history(NodeHistory(name, forgiven=old.forgiven + 1))
    state.withdraw_refusal(name)
    _audit(state, "forgive", node=name, was=old.state)
    resumed = False
    if slurm is not None and not slurm.usable:
        resumed = Executor(scheduler, state).resume_ours(
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
    click.echo(f"{name}: history cleared; {note}")


@node.command("mark")
@click.argument("name")
@click.option(
    "--state",
    "new_state",
    type=click.Choice(["ok", "suspect", "persistent"]),
    required=True,
    help="The state to record (persistent nodes fail the prolog).",
)
@click.pass_obj
def node_mark(settings: Settings, name: str, new_state: str) -> None:
    """Set a node's straggler state by hand (recorded in the audit)."""
    scheduler, state, _ = build(settings)
    _slurm_node(scheduler, name)  # Slurm first: an unknown node gets no ghost history
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
    click.echo(f"{name}: {old.state} -> {new_state}")


@click.command("jobs")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def jobs(settings: Settings, as_json: bool) -> None:
    """Running jobs and what the service knows of them."""
    scheduler, state, _ = build(settings)
    state.r.ping()  # Redis away is an error even when no job runs
    rows = []
    for job in scheduler.jobs():
        if not job.running:
            continue
        js = state.job(job.job_id)
        rows.append(
            {
                "job": job.job_id,
                "user": job.user,
                "policy": js.get("policy") or "-",
                "nodes": ",".join(job.nodes),
                "restarts": job.restarts,
                "evictions": js.get("evictions", "0"),
                "waiting": js.get("waiting") or "-",
            }
        )
    emit_rows(
        rows,
        ["job", "user", "policy", "nodes", "restarts", "evictions", "waiting"],
        as_json=as_json,
    )


@click.group("job")
def job() -> None:
    """One job."""


@job.command("show")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def job_show(settings: Settings, job_id: str, as_json: bool) -> None:
    """Per-rank p50/p95 of step, compute, wait and data; the decisions so far."""
    _, state, store = build(settings)
    by_rank: dict[int, dict[str, list[float]]] = {}
    for r in store.iter_steps(job_id):
        slot = by_rank.setdefault(
            r.rank, {"node": [], "step": [], "compute": [], "comm": [], "data": []}
        )
        for key, value in (
            ("step", r.step_s),
            ("compute", r.compute_s),
            ("comm", r.comm_s),
            ("data", r.data_s),
        ):
            if value is not None:
                slot[key].append(value)
        slot["node"] = [r.node]  # type: ignore[list-item]
    rows = []
    for rank, slot in sorted(by_rank.items()):
        row: dict[str, Any] = {"rank": rank, "node": slot["node"][0] if slot["node"] else ""}
        for key in ("step", "compute", "comm", "data"):
            values = np.asarray(slot[key])
            row[f"{key}_p50_ms"] = (
                round(float(np.median(values)) * 1000, 1) if len(values) else None
            )
            row[f"{key}_p95_ms"] = (
                round(float(np.percentile(values, 95)) * 1000, 1) if len(values) else None
            )
        rows.append(row)
    decisions = state.job_decisions(job_id)
    ignored = {
        k.removeprefix("ignored_"): int(v)
        for k, v in state.job(job_id).items()
        if k.startswith("ignored_")
    }
    if as_json:
        emit_json({"ranks": rows, "decisions": decisions, "ignored_records": ignored})
        return
    emit_table(
        rows,
        [
            "rank",
            "node",
            "step_p50_ms",
            "compute_p50_ms",
            "compute_p95_ms",
            "comm_p50_ms",
            "comm_p95_ms",
            "data_p50_ms",
        ],
    )
    click.echo("")
    emit_table(decisions, ["id", "state", "node", "decision", "saved_s", "cost_s", "reasons"])
    if ignored:
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(ignored.items()))
        click.echo(f"\nrecords not believed (evidence rules): {counts}")


@click.command("pause")
@click.option("--for", "duration", default="30m", show_default=True, help="How long (30m, 2h, 1d).")
@click.pass_obj
def pause(settings: Settings, duration: str) -> None:
    """Stop all actions for a while (detection and audit go on)."""
    seconds = parse_duration(duration)
    _, state, _ = build(settings)
    state.pause(seconds, who=actor())
    _audit(state, "pause", seconds=round(seconds))
    click.echo(f"paused for {_span(seconds)}")


@click.command("resume")
@click.pass_obj
def resume(settings: Settings) -> None:
    """Lift a pause and close the circuit breaker."""
    _, state, _ = build(settings)
    state.resume()
    _audit(state, "resume")
    click.echo("actions resumed")


@click.command("audit")
@click.option("--job", "job_id", help="Only this job.")
@click.option("--since", default="1d", show_default=True, help="How far back (1h, 2d).")
@click.option(
    "--limit", default=1000, show_default=True, type=click.IntRange(1, 100_000), help="Page size."
)
@click.option("--after", help="Start after this audit_id (the last one of the previous page).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def audit(
    settings: Settings,
    job_id: str | None,
    since: str,
    limit: int,
    after: str | None,
    as_json: bool,
) -> None:
    """Every decision and state change, oldest first, one page at a time."""
    if after is not None and not _AUDIT_ID.fullmatch(after):
        raise click.BadParameter("an audit_id looks like 1796050707123-0", param_hint="--after")
    _, state, _ = build(settings)
    entries = state.audit(time.time() - parse_duration(since), job_id, limit, after=after)
    emit_rows(
        entries,
        ["audit_id", "id", "state", "action", "job_id", "node", "decision", "reasons"],
        as_json=as_json,
    )
    if len(entries) == limit and not as_json:
        click.echo(f"(more: --after {entries[-1]['audit_id']})", err=True)


@click.command("status")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def status(settings: Settings, as_json: bool) -> None:
    """Heartbeat, pause and circuit breaker. Exits 1 when no service has cycled recently (no
    heartbeat, or one older than ``stale_after_s``): a health check for systemd or monitoring."""
    _, state, _ = build(settings)
    now = time.time()
    beat = state.last_heartbeat()
    ts = beat.get("ts") if beat else None
    age = round(now - ts, 1) if isinstance(ts, int | float) else None
    stale_after = max(30.0, 10 * settings.service_interval_s)
    healthy = age is not None and age <= stale_after
    paused = state.paused()
    data = {
        "healthy": healthy,
        "heartbeat": beat,
        "heartbeat_age_s": age,
        "stale_after_s": stale_after,
        "paused_s": round(paused) if paused else None,
        "breaker": state.breaker(),
        "open_decisions": len(state.open_decisions()),
    }
    if as_json:
        emit_json(data)
    else:
        if beat is None or age is None:
            line = "no heartbeat (hint: is `straggler serve` running, on this redis_url?)"
        else:
            line = (
                f"{'alive' if healthy else 'STALE'}, {printable(str(beat.get('instance')))}, "
                f"last cycle {age:g} s ago"
                + ("" if healthy else f" (stale after {stale_after:g} s)")
            )
        click.echo(f"service: {line}")
        breaker = printable(str(data["breaker"] or "closed"))
        click.echo(
            f"paused: {'for ' + _span(paused) + ' more' if paused else 'no'}; circuit breaker: "
            f"{breaker}; open decisions: {data['open_decisions']}"
        )
    if not healthy:
        sys.exit(1)


def _span(seconds: float) -> str:
    """1799.6 -> '29m 60s' style, coarse: '29m 59s', '2h 5m', '3d 1h'."""
    s = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if s >= size:
            return f"{s // size}{unit} {s % size // sub_size}{sub}"
    return f"{s // 60}m {s % 60}s" if s >= 60 else f"{s}s"


SBATCH_HELP = """\
STRAGGLER OPTIONS FOR SBATCH, SALLOC AND SRUN (SPANK plugin contrib/spank)

  --straggler-policy=NAME
      The job's straggler policy (`straggler policy list`). An unknown name fails the
      submission with the list of valid names. Default: the plugin's default= argument.
  --straggler-max-requeues=N
      Evict this job at most N times; the policy's own limit still applies.
  --straggler-min-slowdown=PCT
      Act only on slowdowns of at least PCT percent; never below the policy's minimum.
  --straggler-notify=off|log|comment
      How the job hears about detections: its AdminComment (comment, the default), the
      service log only (log), or not at all (off).

Without the plugin: sbatch --comment=straggler:policy=NAME ...
`srun --help` lists these options; `sbatch --help` does not show SPANK options.
"""


@click.command("sbatch-options")
def sbatch_options() -> None:
    """Explain the --straggler-* options of sbatch, salloc and srun."""
    click.echo(SBATCH_HELP, nl=False)


COMMANDS = [sbatch_options, serve, policy, nodes, node, jobs, job, pause, resume, audit, status]
