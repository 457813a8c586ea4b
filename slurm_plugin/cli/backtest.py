"""``straggler backtest TRACE...``: replay traces through detection, decisions and node
history, under one or more policies, and say what each would have cost and saved."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import click

from slurm_plugin.backtest import BacktestResult, run_backtest
from slurm_plugin.cli.output import emit_json, emit_table
from slurm_plugin.config import Settings
from slurm_plugin.errors import TraceError
from slurm_plugin.policy.loader import load_policy
from slurm_plugin.policy.schema import Policy
from slurm_plugin.trace import Trace, concat_traces, read_trace
from slurm_plugin.trace_meta import TraceContext, merge_contexts, read_context
from slurm_plugin.whatif import WhatIf, what_if

_COMPANIONS = (".jobs.csv", ".events.csv")


def trace_files(paths: tuple[Path, ...]) -> list[Path]:
    """The trace files named, a directory standing for every ``*.csv`` in it that is not a
    companion (``*.jobs.csv``, ``*.events.csv``)."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            inside = sorted(
                p for p in path.glob("*.csv") if p.is_file() and not p.name.endswith(_COMPANIONS)
            )
            if not inside:
                raise TraceError(f"{path}: no trace (*.csv) in this directory")
            found += inside
        else:
            found.append(path)
    return found


def _read(paths: list[Path]) -> tuple[Trace, TraceContext]:
    traces = [read_trace(p) for p in paths]
    contexts = [read_context(p) for p in paths]
    return concat_traces(traces), merge_contexts(contexts)


@click.command("backtest")
@click.argument(
    "trace_paths",
    metavar="TRACE...",
    nargs=-1,
    required=True,
    type=click.Path(path_type=Path, exists=True),
)
@click.option(
    "--policy",
    "policy_paths",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Policy TOML; repeat to compare policies (default: built-in defaults, mode evict).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the documented JSON.")
@click.pass_obj
def backtest(
    settings: Settings, trace_paths: tuple[Path, ...], policy_paths: tuple[Path, ...], as_json: bool
) -> None:
    """Replay TRACE.csv files (job_id,rank,node,gpu,step,ts,step_s,compute_s,comm_s,data_s;
    a directory stands for its traces) with their companions TRACE.jobs.csv and
    TRACE.events.csv when present, and print what the service would have detected and
    decided, which nodes would be persistent (under the configured [persistence] rails), and
    per policy the GPU-hours lost to stragglers, spent on evictions and saved."""
    policies = [load_policy(p) for p in policy_paths] or [
        Policy.model_validate({"name": "backtest", "actions": {"mode": "evict"}})
    ]
    started = time.perf_counter()
    trace, context = _read(trace_files(trace_paths))
    runs: list[tuple[Policy, BacktestResult, WhatIf]] = []
    for policy in policies:
        result = run_backtest(trace, policy, settings.persistence, context=context)
        report = what_if(policy.name, result.detections, result.persistent_nodes, trace)
        runs.append((policy, result, report))
    elapsed = time.perf_counter() - started
    assumptions = context.describe()
    if as_json:
        if len(runs) == 1:
            _, result, report = runs[0]
            emit_json({**result.to_dict(), "report": report.to_dict(), "assumptions": assumptions})
        else:
            emit_json(
                {
                    "policies": [
                        {"policy": p.name, **r.to_dict(), "report": w.to_dict()} for p, r, w in runs
                    ],
                    "assumptions": assumptions,
                }
            )
        return
    if len(runs) == 1:
        _, result, _ = runs[0]
        emit_table(
            result.detections,
            [
                "ts",
                "job_id",
                "kind",
                "node",
                "rank",
                "gpu",
                "step",
                "cause",
                "cusum_ratio",
                "action",
            ],
        )
        click.echo(f"\npersistent nodes: {', '.join(result.persistent_nodes) or 'none'}")
    click.echo("")
    emit_table(
        [w.to_dict() for _, _, w in runs],
        [
            "policy",
            "evictions",
            "persistent_nodes",
            "lost_gpu_h",
            "spent_gpu_h",
            "saved_gpu_h",
            "net_gpu_h",
        ],
    )
    for note in assumptions:
        click.echo(f"assumed: {note}")
    result = runs[0][1]
    click.echo(
        f"{result.records:,} records in {elapsed:.2f} s "
        f"({result.records * len(runs) / max(elapsed, 1e-9):,.0f} records/s); "
        f"late or superseded records: {result.late_records:,}; "
        f"ranks beyond their job's nodes: {result.out_of_range:,}"
    )
    if importlib.util.find_spec("pyarrow") is None:
        click.echo("hint: install the 'arrow' extra (pyarrow) to read traces several times faster")
