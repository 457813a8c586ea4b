"""Admin commands: serve, policies, nodes, jobs, pause/resume, audit, status."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import shutil
import sys
import time
from typing import Any

import click
import numpy as np
import structlog

from slurm_plugin.cli import job_runs
from slurm_plugin.cli.common import (
    actor,
    audit_action,
    done,
    json_option,
    parse_duration,
    span,
)
from slurm_plugin.cli.nodes import node, nodes
from slurm_plugin.cli.output import emit_json, emit_rows, emit_table, iso, printable, typed
from slurm_plugin.cli.policies import policy
from slurm_plugin.config import Settings
from slurm_plugin.errors import ConfigError, StragglerError
from slurm_plugin.service import collector
from slurm_plugin.service.factory import build
from slurm_plugin.service.loop import Service
from slurm_plugin.service.metrics import Metrics
from slurm_plugin.slurm.rights import administrator
from slurm_plugin.store.job_state import JobState
from slurm_plugin.store.telemetry_store import TelemetryStore

log = structlog.get_logger(__name__)

_AUDIT_ID = re.compile(r"\d{1,20}-\d{1,20}")


@click.command("serve")
@click.option("--once", is_flag=True, help="Run one cycle and exit.")
@click.option("--dry-run", is_flag=True, help="Detect and decide, but never act on Slurm.")
@json_option
@click.pass_obj
def serve(settings: Settings, once: bool, dry_run: bool, as_json: bool) -> None:
    """Run the policy service (leader-elected; a second instance waits as a standby). A fatal
    configuration (policies, Slurm commands, Redis) exits non-zero before taking the lock.
    --json (with --once) prints the cycle's report; the running service logs JSON lines."""
    if as_json and not once:
        raise click.UsageError("--json needs --once (a running service logs JSON lines)")
    for name in ("scontrol", "squeue", "sinfo"):
        if shutil.which(settings.slurm_command(name)) is None:
            raise ConfigError(
                f"Slurm command {settings.slurm_command(name)!r} not found (hint: install the "
                "Slurm client commands or set [slurm] bin_dir)",
                field="slurm.bin_dir",
            )
    scheduler, state, store = build(settings)
    state.client.ping()  # Redis unreachable: one line from the CLI, before anything else
    state.check_schema()  # a Redis written by another release: exit here
    service = Service(
        settings,
        scheduler,
        state,
        store,
        dry_run=dry_run,
        metrics=Metrics(settings.service.metrics_port, settings.service.metrics_address),
    )
    service.reload_policies()  # no policy directory or no valid default policy: exit here
    if not dry_run:
        _check_rights(settings)
    collector.tune()
    with contextlib.suppress(KeyboardInterrupt):
        report = service.run(once=once)
        if once and report.error:
            raise StragglerError(f"the cycle failed: {report.error}")
        if as_json:
            emit_json(dataclasses.asdict(report))


def _check_rights(settings: Settings) -> None:
    """Say at start-up, not at the first straggler, when Slurm will refuse our actions."""
    admin, who = administrator(
        settings.slurm_command("scontrol"),
        settings.slurm_command("sacctmgr"),
        settings.slurm_env(),
        settings.slurm.command_timeout_s,
    )
    if admin is False:
        log.error(
            "service.not_slurm_admin",
            who=who,
            hint="evictions (our mark in AdminComment) and drains need a Slurm administrator: "
            "sacctmgr modify user NAME set adminlevel=Admin (docs/deploy.md, The service "
            "account); until then the service decides and records, and acts on nothing",
        )
    elif admin is None:
        log.warning("service.slurm_rights_unknown", detail=who)
    else:
        log.info("service.slurm_rights", who=who)


@click.command("jobs")
@json_option
@click.pass_obj
def jobs(settings: Settings, as_json: bool) -> None:
    """Running jobs and what the service knows of them."""
    scheduler, state, _ = build(settings)
    state.client.ping()  # Redis away is an error even when no job runs
    rows = []
    for job in scheduler.jobs():
        if not job.running:
            continue
        job_state = state.job_state(job.job_id)
        rows.append(
            {
                "job": job.job_id,
                "user": job.user,
                "policy": job_state.policy or "-",
                "nodes": ",".join(job.nodes),
                "restarts": job.restarts,
                "evictions": str(job_state.evictions),
                "waiting": job_state.waiting or "-",
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


def _echo_losses(lost: int, missing: int) -> None:
    """The job's steps entries the service never read, when there are any."""
    if lost:
        click.echo(
            f"\nsteps entries lost (trimmed before the service read them): {lost} "
            "(each one rank's flush)"
        )
    if missing:
        click.echo(
            f"\nsteps entries missing (numbered by a rank, never in the stream: a Redis "
            f"failover, or dropped while Redis was away): {missing}"
        )


@job.command("show")
@click.argument("job_id")
@json_option
@click.pass_obj
def job_show(settings: Settings, job_id: str, as_json: bool) -> None:
    """Per-rank p50/p95 of step, compute, wait and data; the decisions so far."""
    _, state, store = build(settings)
    known = state.job_state(job_id)
    current = job_runs.Run.of_state(known)
    # A record stamped before the current job was first submitted is an earlier job's.
    since = (current.first_submit_ts or 0.0) - 1.0 if current is not None else -math.inf
    rows = _rank_rows(store, job_id, since)
    decisions, earlier = job_runs.split([typed(d) for d in state.job_decisions(job_id)], current)
    if not rows and not decisions and not earlier and known == JobState():
        raise StragglerError(
            f"no telemetry, decisions or state for job {printable(job_id[:32])!r} (hint: "
            "`straggler jobs` lists the running ones; decisions expire after "
            "service.decision_retention_s)"
        )
    ignored = known.ignored
    structure = known.structure or []
    lost = known.steps_lost or 0
    missing = known.steps_missing or 0
    if as_json:
        emit_json(
            {
                "ranks": rows,
                "decisions": decisions,
                "ignored_records": ignored,
                "structure": structure,
                "steps_entries_lost": lost,
                "steps_entries_missing": missing,
                "earlier_jobs": earlier,
            }
        )
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
    emit_table(
        decisions,
        [
            "id",
            "detected_ts",
            "state",
            "node",
            "decision",
            "lasted_s",
            "expected_s",
            "lasting_p",
            "saved_s",
            "cost_s",
            "reasons",
        ],
    )
    for d in decisions:
        if isinstance(d.get("goodput_inputs"), dict):
            click.echo(f"\n{_goodput_line(d['id'], d['goodput_inputs'])}")
    if ignored:
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(ignored.items()))
        click.echo(f"\nrecords not believed (evidence rules): {counts}")
    _echo_losses(lost, missing)
    for run in earlier:
        submitted = iso(run["first_submit_ts"]) if run["first_submit_ts"] else "an unknown time"
        click.echo(
            f"\nan earlier job with this id (user {printable(str(run['user'] or '?'))}, first "
            f"submitted {submitted}): {run['decisions']} decision(s), not shown"
        )
    for group in structure:
        nodes = ",".join(printable(str(n)) for n in group.get("nodes", []))
        click.echo(
            f"structure, compared with itself: {group.get('ranks')} ranks on {nodes} compute "
            f"{group.get('offset_pct')} % against the job's median rank"
        )


def _rank_rows(store: TelemetryStore, job_id: str, since: float) -> list[dict[str, Any]]:
    """Per rank: its node and the p50/p95 of step, compute, wait and data, from the records
    stamped from ``since`` on."""
    by_rank: dict[int, dict[str, list[float]]] = {}
    for r in store.iter_steps(job_id):
        if r.ts < since:
            continue
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
    rows: list[dict[str, Any]] = []
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
    return rows


def _goodput_line(decision_id: str, g: dict[str, Any]) -> str:
    """What a decision's goodput figures were computed from, in one line."""
    saved, cost = round(float(g.get("saved_s") or 0)), round(float(g.get("cost_s") or 0))
    lost_from = g.get("lost_work_from") or "a checkpoint"
    return (
        f"goodput of {printable(str(decision_id))}: the node costs {g.get('share_pct')} % of the "
        f"job's time ({g.get('share_from')}); {g.get('remaining_s')} s left "
        f"({g.get('remaining_from')}); a requeue costs {g.get('restart_cost_s')} s restart + "
        f"{g.get('lost_work_s')} s lost work (from {lost_from}), "
        f"{g.get('checkpoint_wait_s')} s waiting for a checkpoint: saves {saved} s, costs {cost} s"
    )


@click.command("pause")
@click.option("--for", "duration", default="30m", show_default=True, help="How long (30m, 2h, 1d).")
@json_option
@click.pass_obj
def pause(settings: Settings, duration: str, as_json: bool) -> None:
    """Stop all actions for a while (detection and audit go on)."""
    seconds = parse_duration(duration)
    _, state, _ = build(settings)
    state.pause(seconds, who=actor())
    audit_action(state, "pause", seconds=round(seconds))
    done(as_json, f"paused for {span(seconds)}", paused_s=round(seconds))


@click.command("resume")
@json_option
@click.pass_obj
def resume(settings: Settings, as_json: bool) -> None:
    """Lift a pause and close the circuit breaker."""
    _, state, _ = build(settings)
    state.resume()
    audit_action(state, "resume")
    done(as_json, "actions resumed", resumed=True)


@click.command("audit")
@click.option("--job", "job_id", help="Only this job.")
@click.option("--since", default="1d", show_default=True, help="How far back (1h, 2d).")
@click.option(
    "--limit", default=1000, show_default=True, type=click.IntRange(1, 100_000), help="Page size."
)
@click.option("--after", help="Start after this audit_id (the last one of the previous page).")
@json_option
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
    entries = [
        {"time": iso(int(e["audit_id"].split("-")[0]) / 1000), **typed(e)}
        for e in state.audit(time.time() - parse_duration(since), job_id, limit, after=after)
    ]
    emit_rows(
        entries,
        ["time", "audit_id", "id", "state", "action", "job_id", "node", "by", "reasons"],
        as_json=as_json,
    )
    if len(entries) == limit and not as_json:
        click.echo(f"(more: --after {entries[-1]['audit_id']})", err=True)


@click.command("status")
@json_option
@click.pass_obj
def status(settings: Settings, as_json: bool) -> None:
    """Heartbeat, pause and circuit breaker. Exits 1 when no service has cycled recently (no
    heartbeat, or one older than ``stale_after_s``): a health check for systemd or monitoring."""
    _, state, _ = build(settings)
    now = time.time()
    beat = state.last_heartbeat()
    ts = beat.get("ts") if beat else None
    age = round(now - ts, 1) if isinstance(ts, int | float) else None
    stale_after = max(30.0, 10 * settings.service.interval_s)
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
            line = "no heartbeat (hint: is `straggler serve` running, on this redis.url?)"
        else:
            line = (
                f"{'alive' if healthy else 'STALE'}, {printable(str(beat.get('instance')))}, "
                f"last cycle {age:g} s ago"
                + ("" if healthy else f" (stale after {stale_after:g} s)")
            )
        click.echo(f"service: {line}")
        breaker = printable(str(data["breaker"] or "closed"))
        click.echo(
            f"paused: {'for ' + span(paused) + ' more' if paused else 'no'}; circuit breaker: "
            f"{breaker}; open decisions: {data['open_decisions']}"
        )
    if not healthy:
        sys.exit(1)


SBATCH_OPTIONS = (
    "--straggler-policy",
    "--straggler-max-requeues",
    "--straggler-min-slowdown",
    "--straggler-notify",
    "--straggler-recovery",
)
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
  --straggler-recovery=requeue|advice
      advice: told first which nodes to leave (`straggler advice JOB`), so that a launcher
      that can continue without them (torchrun with a spare node, `straggler
      leave-on-advice`) does; requeued without them if it has not within the policy's
      advice_deadline_s. requeue: requeued at once (the policy's choice by default).

Without the plugin: sbatch --comment=straggler:policy=NAME ...
`srun --help` lists these options; `sbatch --help` does not show SPANK options.
"""


@click.command("sbatch-options")
@json_option
def sbatch_options(as_json: bool) -> None:
    """Explain the --straggler-* options of sbatch, salloc and srun."""
    if as_json:
        emit_json({"options": list(SBATCH_OPTIONS), "help": SBATCH_HELP})
        return
    click.echo(SBATCH_HELP, nl=False)


COMMANDS = [sbatch_options, serve, policy, nodes, node, jobs, job, pause, resume, audit, status]
