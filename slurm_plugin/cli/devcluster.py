"""``straggler devcluster up|down|status|env``: the local Slurm + Redis cluster."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import click

from slurm_plugin.cli.common import done, json_option
from slurm_plugin.cli.output import emit_json, emit_table
from slurm_plugin.config import Settings

if TYPE_CHECKING:
    from slurm_plugin.devcluster import ClusterStatus, DevCluster


def cluster_of(settings: Settings) -> DevCluster:
    """The development cluster, imported only by the commands that use it (the service and the
    admin commands never load it)."""
    from slurm_plugin.devcluster import DevCluster  # noqa: PLC0415

    return DevCluster.from_settings(settings)


def _print_status(status: ClusterStatus) -> None:
    emit_table(
        [
            {"daemon": d.name, "pid": d.pid or "-", "running": "yes" if d.alive else "no"}
            for d in status.daemons
        ],
        ["daemon", "pid", "running"],
    )
    click.echo("")
    emit_table([{"node": n, "state": s} for n, s in status.nodes.items()], ["node", "state"])
    click.echo(
        f"\nredis: {'ok' if status.redis_ok else 'unreachable'}   "
        f"ready: {'yes' if status.ready else 'no'}"
    )


def _print_env(status: ClusterStatus) -> None:
    for key, value in status.env.items():
        click.echo(f"export {key}={shlex.quote(value)}")


@click.group()
def devcluster() -> None:
    """A real multi-node Slurm cluster and redis-server on this machine (needs root)."""


@devcluster.command()
@click.option(
    "--prolog",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Program run as Slurm's Prolog on every node (after injected faults).",
)
@click.option(
    "--epilog",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Program run as Slurm's Epilog on every node.",
)
@click.option(
    "--plugstack-line",
    "plugstack",
    multiple=True,
    help="A line for plugstack.conf (SPANK plugins); repeatable.",
)
@click.option("--spank", is_flag=True, help="Build and load the SPANK plugin (contrib/spank).")
@click.option(
    "--accounting/--no-accounting",
    default=None,
    help="Run MariaDB and slurmdbd (users and AdminLevel, as production has); "
    "default: keep what the cluster had.",
)
@click.option(
    "--wait",
    "wait_s",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds to wait for every node to become usable.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_obj
def up(
    settings: Settings,
    prolog: Path | None,
    epilog: Path | None,
    plugstack: tuple[str, ...],
    spank: bool,
    accounting: bool | None,
    wait_s: float,
    as_json: bool,
) -> None:
    """Start munge, redis-server, slurmctld and 4 slurmd (idempotent); print what to export."""
    status = cluster_of(settings).up(
        prolog=prolog,
        epilog=epilog,
        plugstack=plugstack or None,
        spank=spank,
        accounting=accounting,
        wait_s=wait_s,
    )
    if as_json:
        emit_json(status.to_dict())
        return
    for note in status.notes:
        click.echo(f"note: {note}")
    click.echo(
        f"cluster up in {status.elapsed_s:.2f} s: "
        + ", ".join(f"{n} {s}" for n, s in status.nodes.items())
    )
    click.echo("# use it with:")
    _print_env(status)


@devcluster.command()
@click.option("--keep-state", is_flag=True, help="Keep the base directory (logs, state).")
@json_option
@click.pass_obj
def down(settings: Settings, keep_state: bool, as_json: bool) -> None:
    """Stop every process the cluster started and remove its /etc/hosts block."""
    stopped = cluster_of(settings).down(keep_state=keep_state)
    message = "stopped: " + (", ".join(stopped) if stopped else "nothing was running")
    done(as_json, message, stopped=stopped)


@devcluster.command()
@json_option
@click.pass_obj
def status(settings: Settings, as_json: bool) -> None:
    """Show the daemons, node states and Redis; exit 1 when the cluster is not ready."""
    result = cluster_of(settings).status()
    if as_json:
        emit_json(result.to_dict())
    else:
        _print_status(result)
    if not result.ready:
        raise SystemExit(1)


@devcluster.command()
@json_option
@click.pass_obj
def env(settings: Settings, as_json: bool) -> None:
    """Print the shell exports that point Slurm commands and our tools at the cluster."""
    values = cluster_of(settings).env()
    if as_json:
        emit_json(values)
        return
    for key, value in values.items():
        click.echo(f"export {key}={shlex.quote(value)}")
