"""StepReporter and the store against a real redis-server."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from structlog.testing import capture_logs

from slurm_plugin import StepReporter
from slurm_plugin.cli.main import cli
from slurm_plugin.model import keys
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from slurm_plugin.telemetry import timers as timers_module
from tests.integration.conftest import RedisServer, Slurm, wait_for

REPO = Path(__file__).resolve().parents[2]

_WRITER = """
import sys
from slurm_plugin import StepReporter
rep = StepReporter.from_env()
for step in range(int(sys.argv[1])):
    rep.record(step, 0.1, 0.06 + 0.001 * int(sys.argv[2]), 0.03, 0.01)
rep.close()
sys.exit(0 if rep.published == int(sys.argv[1]) else 3)
"""


def test_round_trip_from_several_processes(redis_url: str) -> None:
    """Records from 4 reporter processes arrive complete and in step order per rank."""
    steps, ranks = 1500, 4
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(steps), str(rank)],
            cwd=REPO,
            env={
                **os.environ,
                "SLURM_JOB_ID": "77",
                "SLURM_PROCID": str(rank),
                "SLURMD_NODENAME": f"node{rank % 2 + 1}",
                "SLURM_LOCALID": str(rank // 2),
                "STRAGGLER_REDIS_URL": redis_url,
            },
        )
        for rank in range(ranks)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0] * ranks
    store = TelemetryStore(connect(redis_url))
    records = list(store.iter_steps("77"))
    assert len(records) == steps * ranks
    for rank in range(ranks):
        mine = [r for r in records if r.rank == rank]
        assert [r.step for r in mine] == list(range(steps))
        assert {r.node for r in mine} == {f"node{rank % 2 + 1}"}
        assert {r.gpu for r in mine} == {rank // 2}
        assert mine[0].compute_s == pytest.approx(0.06 + 0.001 * rank)
    assert store.client.ttl(keys.job_steps("77")) > 0


class _Ticks:
    """The step timers' ``time`` with a ``perf_counter`` the test moves (no sleep to race the
    machine's load); every other function is the real one."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_timing_helpers_and_events(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`with rep.step()` / `rep.phase()` measure the phases (and the step around them, what
    happens between phases included); events land in the events stream."""
    ticks = _Ticks()
    monkeypatch.setattr(timers_module, "time", ticks)
    store = TelemetryStore(connect(redis_url))
    with StepReporter("78", 0, "node1", store_factory=lambda: store, flush_interval_s=0.1) as rep:
        for step in range(3):
            with rep.step():
                with rep.phase("data"):
                    ticks.now += 0.002
                with rep.phase("compute"):
                    ticks.now += 0.02 + 0.01 * step
                ticks.now += 0.001  # between phases: the step's, no phase's
                with rep.phase("comm"):
                    ticks.now += 0.005
                with rep.phase("comm"):  # a phase entered twice in a step adds up
                    ticks.now += 0.003
        rep.event("checkpoint_end", step=2)
    records = list(store.iter_steps("78"))
    assert [r.step for r in records] == [0, 1, 2]
    for step, r in enumerate(records):
        assert r.data_s == pytest.approx(0.002)
        assert r.compute_s == pytest.approx(0.02 + 0.01 * step)
        assert r.comm_s == pytest.approx(0.008)
        assert r.step_s == pytest.approx(0.031 + 0.01 * step)
    events = store.read_json(keys.job_events("78"))
    assert [(e["name"], e["step"]) for e in events] == [("checkpoint_end", 2)]


def test_bad_values_are_counted_and_dropped(redis_url: str) -> None:
    """NaN, infinities, negatives and non-numbers never raise and never reach Redis."""
    store = TelemetryStore(connect(redis_url))
    with capture_logs() as logs, StepReporter("79", 0, "node1", store_factory=lambda: store) as rep:
        rep.record(0, 0.1, 0.05)
        rep.record(1, float("nan"))
        rep.record(2, 0.1, float("inf"))
        rep.record(3, 0.1, -0.5)
        rep.record(4, "fast")  # type: ignore[arg-type]
        rep.record(-1, 0.1)
        rep.record(5, 0.1, comm_s=0.02)
    assert rep.invalid == 5
    warnings = [e for e in logs if e["event"] == "telemetry.invalid_values"]
    assert sum(e["dropped_now"] for e in warnings) == 5
    assert [r.step for r in store.iter_steps("79")] == [0, 5]


def test_a_nan_event_is_refused_alone_and_the_steps_are_published(redis_url: str) -> None:
    """Issue 25: ``event("eval", loss=nan)`` (a diverged loss) used to fail the flush and lose
    its steps while ``flush()`` said True. Now the event alone is refused and counted."""
    store = TelemetryStore(connect(redis_url))
    with capture_logs() as logs, StepReporter("81", 0, "node1", store_factory=lambda: store) as rep:
        for step in range(50):
            rep.record(step, 0.1, 0.05)
        rep.event("eval", loss=float("nan"))
        rep.event("eval", loss=float("inf"), step=3)
        rep.event("checkpoint_end", step=49, rank=999, node="elsewhere")
        assert rep.flush()
    assert (rep.published, rep.invalid_events) == (50, 2)
    assert [r.step for r in store.iter_steps("81")] == list(range(50))
    (stored,) = store.read_json(keys.job_events("81"))
    # The reporter's own fields win over the job's: a job cannot claim another rank's event.
    assert (stored["name"], stored["rank"], stored["node"]) == ("checkpoint_end", 0, "node1")
    refused = [e for e in logs if e["event"] == "telemetry.invalid_event"]
    assert [e["event_name"] for e in refused] == ["eval", "eval"]


def test_a_nan_event_buffered_in_an_outage_costs_no_steps(private_redis: RedisServer) -> None:
    """Issue 25: during an outage 5,000 buffered records went at once with one NaN event."""
    store = TelemetryStore(connect(private_redis.url, retries=0))
    rep = StepReporter(
        "82", 0, "node1", store_factory=lambda: store, flush_interval_s=0.05, buffer_records=10000
    )
    private_redis.stop()
    for step in range(5000):
        rep.record(step, 0.1, 0.05)
    rep.event("eval", loss=float("nan"))
    assert not rep.flush(timeout_s=0.5)
    private_redis.start()
    assert rep.flush(timeout_s=30)
    rep.close()
    assert (rep.published, rep.invalid_events, rep.dropped) == (5000, 1, 0)
    assert len(list(store.iter_steps("82"))) == 5000


def test_redis_outage_never_slows_training(private_redis: RedisServer) -> None:
    """Redis stopped mid-run: step time stays near its baseline, drops are counted and
    reported, and publishing resumes once Redis is back."""
    store_url = private_redis.url
    rep = StepReporter(
        "80",
        0,
        "node1",
        flush_interval_s=0.05,
        buffer_records=2000,
        backoff_s=(0.05, 0.2),
        store_factory=lambda: TelemetryStore(connect(store_url, timeout_s=0.5, retries=0)),
    )

    def train(first: int, count: int) -> list[float]:
        durations = []
        for step in range(first, first + count):
            started = time.perf_counter()
            sum(i * i for i in range(3000))  # the "training" work
            rep.record(step, 0.001, 0.001, 0.0)
            durations.append(time.perf_counter() - started)
        return durations

    baseline = statistics.median(train(0, 1000))
    wait_for(lambda: rep.published == 1000, 10, "the baseline to be published")
    private_redis.stop()
    outage = statistics.median(train(1000, 5000))
    private_redis.start()
    wait_for(lambda: rep.dropped > 0 and rep.published > 1000, 20, "publishing to resume")
    train(6000, 100)
    assert rep.flush(10)
    rep.close()

    assert outage < baseline * 1.5 + 0.0005, (baseline, outage)
    assert rep.dropped == 3000  # 5000 records during the outage, 2000 kept
    store = TelemetryStore(connect(store_url))
    # The restarted server (no persistence) holds what was kept during the outage: the newest
    # 2000 records, then the steps after it.
    steps = [r.step for r in store.iter_steps("80")]
    assert steps == list(range(4000, 6100))
    dropped_events = [
        e for e in store.read_json(keys.job_events("80")) if e["name"] == "telemetry_dropped"
    ]
    assert sum(e["dropped"] for e in dropped_events) == 3000


def test_export_writes_the_trace_csv(redis_url: str, tmp_path: Path) -> None:
    """`straggler export JOB -o FILE` writes the documented header and one row per record,
    with the rank's peer group (published by the reporter) in the last column."""
    store = TelemetryStore(connect(redis_url))
    with StepReporter("81", 1, "node2", 3, store_factory=lambda: store, group="pp=1") as rep:
        rep.record(0, 0.25, 0.2, 0.04)
        rep.record(1, 0.25, 0.21, 0.03, 0.01)
    out = tmp_path / "trace.csv"
    result = CliRunner().invoke(
        cli, ["export", "81", "-o", str(out)], env={"STRAGGLER_REDIS_URL": redis_url}
    )
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    assert lines[0] == "job_id,rank,node,gpu,step,ts,step_s,compute_s,comm_s,data_s,group"
    assert len(lines) == 3
    assert lines[1].startswith("81,1,node2,3,0,")
    assert lines[1].endswith(",0.25,0.2,0.04,,pp=1")
    assert lines[2].endswith(",0.25,0.21,0.03,0.01,pp=1")


def test_export_writes_the_companions_the_backtest_reads(
    slurm: Slurm, env: dict[str, str], job_dir: Path, tmp_path: Path
) -> None:
    """Issue 24: `straggler export` of a real job writes TRACE.jobs.csv (its start and the end
    of its time limit, as Slurm says) and TRACE.events.csv (its checkpoints, from Redis);
    `straggler backtest` reads both and no longer assumes them. A job Slurm does not know
    gets no jobs file and a one-line warning, never invented facts."""
    job_id = slurm.sbatch("-N1", "--time=30", f"--output={job_dir / 'x.log'}", "--wrap", "sleep 60")
    record = slurm.wait_job(job_id, "RUNNING")
    store = TelemetryStore(connect(env["STRAGGLER_REDIS_URL"]))
    with StepReporter(job_id, 0, "node1", 0, store_factory=lambda: store) as rep:
        rep.record(0, 0.25, 0.2, 0.04)
        rep.event("checkpoint_end", step=0)
        rep.record(1, 0.25, 0.21, 0.03)
    out = tmp_path / "trace.csv"
    result = CliRunner().invoke(cli, ["export", job_id, "-o", str(out), "--json"], env=env)
    assert result.exit_code == 0, result.output
    written = json.loads(result.output)
    assert (written["records"], written["events"], written["jobs"]) == (2, 1, 1)
    jobs = (tmp_path / "trace.jobs.csv").read_text().splitlines()
    assert jobs[0] == "job_id,start_ts,end_limit_ts"
    got_id, start, limit = jobs[1].split(",")
    started = datetime.fromisoformat(record["StartTime"]).timestamp()
    assert got_id == job_id
    assert float(start) == pytest.approx(started, abs=1)
    assert float(limit) - float(start) == pytest.approx(30 * 60, abs=1)
    events = (tmp_path / "trace.events.csv").read_text().splitlines()
    assert events[0] == "job_id,ts,name"
    assert events[1].startswith(f"{job_id},")
    assert events[1].endswith(",checkpoint_end")
    replayed = CliRunner().invoke(cli, ["backtest", str(out), "--json"])
    assert replayed.exit_code == 0, replayed.output
    assert not any("TRACE.jobs.csv" in a for a in json.loads(replayed.output)["assumptions"])

    with StepReporter("4242", 0, "node1", 0, store_factory=lambda: store) as rep:
        rep.record(0, 0.25, 0.2, 0.04)
    lone = tmp_path / "lone.csv"
    result = CliRunner().invoke(cli, ["export", "4242", "-o", str(lone)], env=env)
    assert result.exit_code == 0, result.output
    assert "warning: no 4242 in Slurm" in result.output
    assert not (tmp_path / "lone.jobs.csv").exists()
    assert (tmp_path / "lone.events.csv").read_text().splitlines() == ["job_id,ts,name"]
