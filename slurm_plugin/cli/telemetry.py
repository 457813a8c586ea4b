"""``straggler export``, ``straggler sidecar`` and ``straggler relay``: telemetry commands."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import click

from slurm_plugin.cli.common import json_option, this_node
from slurm_plugin.cli.output import emit_json
from slurm_plugin.config import Settings
from slurm_plugin.errors import StragglerError
from slurm_plugin.model.records import sort_records
from slurm_plugin.slurm.scheduler import ScontrolScheduler
from slurm_plugin.store.telemetry_store import TelemetryStore, connect_from
from slurm_plugin.telemetry.relay import Relay
from slurm_plugin.telemetry.sidecar import Sidecar
from slurm_plugin.trace import write_trace
from slurm_plugin.trace_meta import JobFacts, companion, write_events, write_jobs


def _store(settings: Settings) -> TelemetryStore:
    return TelemetryStore(connect_from(settings))


@click.command("export")
@click.argument("job_id")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Trace CSV to write (default: stdout); its companions TRACE.jobs.csv and "
    "TRACE.events.csv go beside it.",
)
@json_option
@click.pass_obj
def export(settings: Settings, job_id: str, output: Path | None, as_json: bool) -> None:
    """Write JOB_ID's step records from Redis as a trace CSV (the backtest's input); with
    --output also the job's start and time limit (from Slurm) and its events (from Redis)
    beside it; with --json print what was written as JSON."""
    if as_json and output is None:
        raise click.UsageError("--json needs --output: the CSV itself goes to stdout otherwise")
    store = _store(settings)
    records = sort_records(store.iter_steps(job_id))
    if output is None:
        rows = write_trace(records, sys.stdout)
        click.echo(f"exported {rows} records of job {job_id}", err=True)
        return
    rows = _write(output, lambda out: write_trace(records, out))
    events = _write(
        companion(output, "events"),
        lambda out: write_events(((job_id, t, n) for t, n in store.iter_events(job_id)), out),
    )
    facts, why = _facts(settings, job_id)
    jobs = _write(companion(output, "jobs"), lambda out: write_jobs(facts, out)) if facts else 0
    if as_json:
        emit_json(
            {
                "job_id": job_id,
                "records": rows,
                "output": str(output),
                "events": events,
                "jobs": jobs,
                "jobs_missing": why,
            }
        )
        return
    click.echo(f"exported {rows} records and {events} events of job {job_id}", err=True)
    if why:
        click.echo(f"warning: {why}", err=True)


def _write(path: Path, write: Callable[[TextIO], int]) -> int:
    """Write ``path`` through a temporary file (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as handle:
        n = write(handle)
    tmp.replace(path)
    return n


def _facts(settings: Settings, job_id: str) -> tuple[list[tuple[str, JobFacts]], str | None]:
    """The job's start and the end of its time limit as Slurm knows them, or why not."""
    try:
        info = ScontrolScheduler(settings).job(job_id)
    except StragglerError as exc:
        return [], (
            f"no {job_id} in Slurm ({exc}): TRACE.jobs.csv not written; the backtest will "
            "assume the job started at its first record, without a time limit"
        )
    limit = None
    if info.start_time is not None and info.time_limit_s is not None:
        limit = info.start_time + info.time_limit_s
    return [(job_id, JobFacts(info.start_time, limit))], None


@click.command("sidecar")
@click.option(
    "--job",
    "job_id",
    default=lambda: os.environ.get("SLURM_JOB_ID"),
    help="Job whose gpu stream gets the samples (default: $SLURM_JOB_ID; none: the node's hash).",
)
@click.option(
    "--node",
    default=this_node,
    help="Node name (default: this host).",
)
@click.option(
    "--interval",
    "interval_s",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between samples.",
)
@click.option("--count", type=click.IntRange(min=1), help="Stop after this many samples.")
@click.option("--once", is_flag=True, help="Print one sample as JSON without publishing.")
@json_option
@click.pass_obj
def sidecar(
    settings: Settings,
    job_id: str | None,
    node: str,
    interval_s: float,
    count: int | None,
    once: bool,
    as_json: bool,
) -> None:
    """Sample this node's GPUs (NVML) and CPU signals every INTERVAL and publish them
    (--json: one sample printed as JSON, not published, as --once)."""
    node_sidecar = Sidecar(_store(settings), node, job_id=job_id or None)
    try:
        if once or as_json:
            emit_json(node_sidecar.sample())
            return
        node_sidecar.run(interval_s, count)
    except KeyboardInterrupt:
        pass
    finally:
        node_sidecar.close()


@click.command("relay")
@click.option(
    "--node",
    default=this_node,
    help="This node's name, put on every flush relayed (default: this host).",
)
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Unix socket to listen on (default: the telemetry.relay_socket setting).",
)
@click.option(
    "--tick",
    "tick_s",
    type=click.FloatRange(min=0.05, max=10.0),
    default=1.0,
    show_default=True,
    help="Seconds between writes: each writes one entry per job with the flushes received.",
)
@json_option
@click.pass_obj
def relay(
    settings: Settings, node: str, socket_path: Path | None, tick_s: float, as_json: bool
) -> None:
    """Publish this node's ranks' step timings over one Redis connection (run as root, one per
    node): ranks send their flushes to the socket, and the relay refuses a flush for any job
    but the sending process's own. On SIGTERM it stops; --json then prints what it relayed."""
    path = socket_path or settings.telemetry.relay_socket
    if path is None:
        raise click.UsageError("no socket: give --socket or set telemetry.relay_socket")
    server = Relay(_store(settings), node, path, tick_s=tick_s)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        server.start()
    except OSError as exc:
        raise StragglerError(
            f"cannot listen on {path}: {exc.strerror or exc} (hint: run it as root, or give "
            "--socket a path you may create)"
        ) from exc
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    counts = {"flushes": server.flushes, "entries": server.entries, "refused": server.refused}
    if as_json:
        emit_json({"node": node, **counts})
    else:
        click.echo(
            f"relayed {server.flushes} flushes in {server.entries} entries, "
            f"refused {server.refused}",
            err=True,
        )
