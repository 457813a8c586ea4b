"""``straggler backtest TRACE``: replay a trace through detection and node history."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import click

from slurm_plugin.backtest import run_backtest
from slurm_plugin.cli.output import emit_json, emit_table
from slurm_plugin.config import Settings
from slurm_plugin.policy.loader import load_policy
from slurm_plugin.policy.schema import Policy
from slurm_plugin.trace import read_trace


@click.command("backtest")
@click.argument(
    "trace_path", metavar="TRACE.csv", type=click.Path(path_type=Path, dir_okay=False, exists=True)
)
@click.option(
    "--policy",
    "policy_path",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Policy TOML (default: built-in defaults, action mode evict).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the documented JSON.")
@click.pass_obj
def backtest(settings: Settings, trace_path: Path, policy_path: Path | None, as_json: bool) -> None:
    """Replay TRACE.csv (job_id,rank,node,gpu,step,ts,step_s,compute_s,comm_s,data_s) and
    print what the service would have detected, and which nodes would be persistent (under
    the configured [persistence] rails)."""
    policy = (
        load_policy(policy_path)
        if policy_path
        else Policy.model_validate({"name": "backtest", "actions": {"mode": "evict"}})
    )
    started = time.perf_counter()
    trace = read_trace(trace_path)
    result = run_backtest(trace, policy, settings.persistence)
    elapsed = time.perf_counter() - started
    if as_json:
        emit_json(result.to_dict())
        return
    emit_table(
        result.detections,
        ["ts", "job_id", "kind", "node", "rank", "gpu", "step", "cause", "score", "action"],
    )
    click.echo(f"\npersistent nodes: {', '.join(result.persistent_nodes) or 'none'}")
    click.echo(
        f"{result.records:,} records in {elapsed:.2f} s "
        f"({result.records / max(elapsed, 1e-9):,.0f} records/s); "
        f"late or superseded records: {result.late_records:,}; "
        f"ranks beyond their job's nodes: {result.out_of_range:,}"
    )
    if importlib.util.find_spec("pyarrow") is None:
        click.echo("hint: install the 'arrow' extra (pyarrow) to read traces several times faster")
