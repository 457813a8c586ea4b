"""``straggler advice JOB`` (what the service advises a job) and ``straggler leave-on-advice``
(run a node's launcher, stop it when the advice asks the node to leave)."""

from __future__ import annotations

import os
import sys
import time
import tomllib
from typing import Any

import click

from slurm_plugin.cli.common import json_option, span, this_node
from slurm_plugin.cli.output import emit_json
from slurm_plugin.config import Settings, load_settings
from slurm_plugin.errors import StragglerError
from slurm_plugin.model import keys
from slurm_plugin.store import advice, credentials
from slurm_plugin.store.telemetry_store import connect_from
from slurm_plugin.telemetry import leave


def _client(settings: Settings, job_id: str) -> Any:
    """Inside the job: the job's own credential (the prolog's file), else ``settings``."""
    if os.environ.get("SLURM_JOB_ID") == job_id:
        try:
            settings = credentials.job_settings(job_id, os.environ, load_settings)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise StragglerError(
                f"job credential file unusable: {exc} (hint: run this inside job {job_id} "
                "as its user, or as an admin outside it)"
            ) from exc
    return connect_from(settings, decode=True)


@click.command("advice")
@click.argument("job_id")
@json_option
@click.pass_obj
def show_advice(settings: Settings, job_id: str, as_json: bool) -> None:
    """What the service advises JOB_ID: which nodes to leave, why, its decision and until
    when it holds (then the job is requeued without them). Works inside the job with its
    own credential."""
    keys.check_job_id(job_id)
    found = advice.read(_client(settings, job_id), job_id)
    now = time.time()
    if as_json:
        emit_json(
            {"job_id": job_id, "advice": None}
            if found is None
            else {"job_id": job_id, "advice": found.model_dump(), "holds": found.holds(now)}
        )
        return
    if found is None:
        click.echo(f"job {job_id}: no advice")
        return
    left = found.deadline_ts - now
    until = f"holds {span(left)} more" if left > 0 else f"expired {span(-left)} ago"
    click.echo(
        f"job {job_id}: leave {', '.join(found.leave)} (decision {found.decision_id}, {until}): "
        + "; ".join(found.reasons)
    )


@click.command(
    "leave-on-advice",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--job",
    "job_id",
    default=lambda: os.environ.get("SLURM_JOB_ID", ""),
    help="The job (default: $SLURM_JOB_ID).",
)
@click.option(
    "--node",
    default=this_node,
    help="The node this launcher runs on (default: $SLURMD_NODENAME, else this host).",
)
@click.option(
    "--every",
    "every_s",
    type=click.FloatRange(min=0.2, max=600),
    default=2.0,
    show_default=True,
    help="Seconds between reads of the advice.",
)
@json_option
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, required=True)
@click.pass_obj
def leave_on_advice(
    settings: Settings,
    job_id: str,
    node: str,
    every_s: float,
    as_json: bool,
    argv: tuple[str, ...],
) -> None:
    """Run ARGV (one node's launcher, e.g. `torchrun --nnodes 3:4 ...`); when the service
    advises the job to leave this node, stop it and report that the node left (exit 0).
    Otherwise exit with ARGV's status. Options go before ARGV (`--` before it is safest).
    Use with `--straggler-recovery=advice`."""
    if not job_id:
        raise click.UsageError("no job: run inside a Slurm job or pass --job")
    keys.check_job_id(job_id)
    keys.check_node(node)
    watch = leave.redis_watch(job_id, node, _client(settings, job_id), every_s=every_s)
    status, left = leave.run(watch, argv)
    if as_json:
        emit_json(
            {
                "job_id": job_id,
                "node": node,
                "status": status,
                "left": left is not None,
                "decision_id": None if left is None else left.decision_id,
            }
        )
    elif left is not None:
        click.echo(f"{node} left job {job_id} on advice {left.decision_id}", err=True)
    sys.exit(status)


COMMANDS = [show_advice, leave_on_advice]
