"""``straggler demo``: the whole product on the dev cluster, with a real straggler."""

from __future__ import annotations

import functools
import json
import signal
from pathlib import Path
from typing import Any

import click

from slurm_plugin.cli.common import json_option
from slurm_plugin.cli.devcluster import cluster_of
from slurm_plugin.cli.output import emit_json
from slurm_plugin.config import Settings
from slurm_plugin.errors import StragglerError


@click.command("demo")
@click.option("--steps", type=int, default=400, show_default=True, help="Training steps.")
@click.option(
    "--slow-at",
    type=int,
    default=60,
    show_default=True,
    help="Step at which node3 is slowed down.",
)
@click.option(
    "--quota",
    "quota_pct",
    type=float,
    default=10.0,
    show_default=True,
    help="CPU quota of the slowed node, percent of one CPU.",
)
@click.option(
    "--baseline/--no-baseline",
    default=True,
    show_default=True,
    help="Also run the same job under `observe` to measure the goodput gained.",
)
@click.option(
    "--advice/--no-advice",
    default=False,
    show_default=True,
    help="Also run the job under torch elastic on 4 nodes (3 needed) with advice first: node3 "
    "left inside the allocation, no requeue; onset to a healthy step compared. One rank a "
    "node steps ~3x faster here, so this run takes 3x --steps (node3 slow for as long).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("demo-report"),
    show_default=True,
    help="Where the report goes.",
)
@json_option
@click.pass_obj
def demo(
    settings: Settings,
    steps: int,
    slow_at: int,
    quota_pct: float,
    baseline: bool,
    advice: bool,
    out_dir: Path,
    as_json: bool,
) -> None:
    """Run a real DDP job on 3 of the 4 dev nodes, slow node3 down for real, and watch the
    service detect it and requeue the job without node3; then report."""
    try:
        from slurm_plugin.demo.report import headline, write_report  # noqa: PLC0415 - heavy
    except ImportError as exc:
        raise StragglerError(
            f"the demo's report needs the demo extra ({exc.name} is missing; hint: "
            "pip install 'slurm-straggler[demo]', or run `make demo`)"
        ) from exc
    from slurm_plugin.demo.export import write_run  # noqa: PLC0415
    from slurm_plugin.demo.run import REPO, run_scenario, summarize  # noqa: PLC0415

    # SIGTERM (a CI runner, `timeout`) must run the clean-up below like Ctrl-C does: stop the
    # service, lift node3's CPU quota, restore the prolog. Python's default handler would not.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # --json: progress on stderr, the summaries as one JSON document on stdout.
    say = functools.partial(click.echo, err=as_json)
    cluster = cluster_of(settings)
    status = cluster.up(spank=True)
    say(f"cluster up: {', '.join(f'{n} {s}' for n, s in status.nodes.items())}")
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    # The job under `evict`, then (the baseline) the same job under `observe`: detected,
    # never evicted; then (--advice) under torch elastic with advice first. Each run has its
    # own Redis database.
    plans = [("evict", 13, "requeue")]
    plans += [("observe", 12, "requeue")] if baseline else []
    plans += [("evict", 11, "advice")] if advice else []
    for policy, redis_db, recovery in plans:
        extra: dict[str, Any] = {}
        run_steps = steps
        if policy == "observe":
            say("\nbaseline: the same job under `observe` (detected, never evicted)")
        if recovery == "advice":
            say("\nadvice: the job under torch elastic on 4 nodes, 3 needed (node3 may leave)")
            extra = {
                "script": REPO / "examples" / "elastic_train.sbatch",
                "submit_args": ["--straggler-recovery=advice"],
            }
            run_steps = 3 * steps
        work = out_dir.resolve() / (policy if recovery == "requeue" else "advice")
        run = run_scenario(
            settings,
            cluster,
            work,
            policy=policy,
            steps=run_steps,
            slow_at=slow_at,
            quota_pct=quota_pct,
            redis_db=redis_db,
            say=say,
            **extra,
        )
        runs.append((run, summarize(run)))
        # Its first run as a trace the backtest replays, with what the run knows beside it.
        write_run(run, runs[-1][1], work / "trace.csv")
    ratio = runs[0][0].total_s / runs[1][0].total_s if baseline else None
    compared = _compared([s for _, s in runs])
    report = out_dir / "report.html"
    write_report(report, runs)
    (out_dir / "summary.json").write_text(json.dumps([s for _, s in runs], indent=2))
    if as_json:
        emit_json(
            {
                "runs": [s for _, s in runs],
                "ratio": ratio,
                "to_healthy_s": compared,
                "report": str(report),
            }
        )
        return
    click.echo("\nsummary")
    for _, summary in runs:
        for key, value in summary.items():
            if key != "decisions":
                click.echo(f"  {key:24} {_shown(value)}")
        click.echo("")
    click.echo(headline([s for _, s in runs]))
    for start in ("onset", "action"):
        key = f"{start}_to_healthy_s"
        figures = {r: f.get(key) for r, f in compared.items()}
        line = f"{start} to a healthy step: " + ", ".join(
            f"{r} {_shown(v)} s" for r, v in figures.items()
        )
        requeue, advised = figures.get("requeue"), figures.get("advice")
        if requeue and advised:
            line += f" (requeue / advice: {requeue / advised:.2f})"
        click.echo(line)
    click.echo(f"report: {report}")


def _compared(summaries: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per recovery that evicted (requeue, advice): onset and its action (the requeue, the
    advice) to the first healthy step."""
    return {
        s["recovery"]: {
            "onset_to_healthy_s": s.get("onset_to_healthy_s"),
            "action_to_healthy_s": s.get("action_to_healthy_s"),
        }
        for s in summaries
        if s.get("policy") == "evict"
    }


def _shown(value: object) -> str:
    """A summary value for the terminal: "-" for missing or NaN, lists joined."""
    if value is None or (isinstance(value, float) and value != value):  # noqa: PLR0124 - NaN
        return "-"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
