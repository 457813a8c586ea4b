"""Service cycle time with many concurrent jobs: N jobs of 8 ranks at 1 step/s (default 2,000).

``--relayed``: each node's ranks publish through the node relay (one entry per node and flush
instead of one per rank); "records/s": the records read per second of the cycles' own time
(what one instance can take in); "detection waited": the longest any job's records waited for
detection (the cycle gives detection a share of the interval, the longest-waiting first).

The real Service, its state and telemetry store on a real Redis; Slurm is
``slurm_plugin.testing.FakeScheduler`` (2,000 jobs cannot run on this machine); each job is
registered as its prolog would. Each cycle
every rank publishes the steps of one interval (2 s) as it would, then one cycle runs; the
cycle's own duration is measured (publishing is the ranks' work, not the service's). Run
against an empty Redis database (it refuses any other):
``STRAGGLER_REDIS_URL=redis://127.0.0.1:16379/13 python -m benchmarks.bench_many_jobs``.
At the end it deletes the keys it wrote (the database was empty before), never anything else.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._common import clear, empty_redis, machine, table
from slurm_plugin.config import Settings
from slurm_plugin.model import keys
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.model.records import decode_header, encode_steps
from slurm_plugin.model.relayed import encode_relayed
from slurm_plugin.service import collector
from slurm_plugin.service.loop import Service
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store import registration
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from slurm_plugin.testing import FakeScheduler

RANKS_PER_JOB, NODES_PER_JOB, INTERVAL_S = 8, 1, 2.0


def jobs_and_nodes(count: int, now: float) -> tuple[list[JobInfo], list[NodeInfo]]:
    """``count`` running jobs of one 8-GPU node each, under the observe policy."""
    jobs, nodes = [], []
    for i in range(count):
        node = f"gpu{i:05d}"
        nodes.append(NodeInfo(node, "allocated", (), "", ("gpu",)))
        jobs.append(
            JobInfo(
                job_id=str(100_000 + i),
                name="bench",
                state="RUNNING",
                reason="None",
                nodes=(node,),
                excluded=(),
                restarts=0,
                requeue=True,
                comment="straggler:policy=observe",
                admin_comment="",
                partition="gpu",
                node_count=NODES_PER_JOB,
                user="bench",
                time_limit_s=4 * 3600.0,
                start_time=now - 60,
                priority=1,
                submit_time=now - 120,
            )
        )
    return jobs, nodes


def publish(
    store: TelemetryStore, jobs: list[JobInfo], first_step: int, t0: float, relayed: bool
) -> int:
    """One interval of steps for every rank of every job, as reporters flushing every second
    write them: one entry per rank and second, or (``relayed``) one per node and second, as
    the node relay packs them; returns the records written."""
    pipe = store.client.pipeline(transaction=False)
    written = 0
    for job in jobs:
        for second in range(int(INTERVAL_S)):
            step = first_step + second
            flushes: list[dict[Any, Any]] = []
            for rank in range(RANKS_PER_JOB):
                compute = 0.7 * (1 + 0.01 * ((rank * 7 + step * 13) % 11 - 5) / 5)
                raws = [(step, t0 + step, 1.0, compute, 0.2, 0.1)]
                flushes.append(encode_steps(rank, job.nodes[0], rank, 0, raws))
                written += 1
            if relayed:
                heads = [decode_header(f) for f in flushes]
                flushes = [encode_relayed(job.nodes[0], heads, f"{'0' * 16}.{step + 1}")]
            for fields in flushes:
                pipe.xadd(keys.job_steps(job.job_id), fields, maxlen=1000, approximate=True)
    pipe.execute()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[200, 2000])
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument(
        "--relayed", action="store_true", help="one entry per node per flush (the node relay)"
    )
    args = parser.parse_args()
    url, client = empty_redis()
    rows = []
    try:
        for count in args.jobs:
            rows.append(run(url, count, args.cycles, args.relayed))
            clear(client)
    finally:
        clear(client)
    print(f"machine: {machine()}")
    print(
        table(
            [
                "jobs x ranks" + (" (relayed)" if args.relayed else ""),
                "records per cycle",
                "cycle p50",
                "cycle p95",
                "cycle max",
                "records/s",
                "detection waited (max)",
            ],
            rows,
        )
    )


def run(url: str, count: int, cycles: int, relayed: bool) -> list[object]:
    now = time.time()
    jobs, nodes = jobs_and_nodes(count, now)
    store = TelemetryStore(connect(url))
    settings = Settings(
        redis={"url": url},
        service={
            "policy_dir": Path(__file__).resolve().parents[1] / "policies",
            "interval_s": INTERVAL_S,
        },
    )
    for job in jobs:  # as each job's prolog does
        registration.register(
            store.client,
            job.job_id,
            registration.Registration(
                policy="observe", nodes=job.nodes[0], user="bench", registered_at=f"{now:.3f}"
            ),
        )
    service = Service(
        settings, FakeScheduler(jobs, nodes), ServiceState(connect(url, decode=True)), store
    )
    collector.tune()  # as `straggler serve` does
    durations, records, waited = [], [], []
    for cycle in range(cycles):
        publish(store, jobs, cycle * int(INTERVAL_S), now, relayed)
        report = service.cycle()
        if report.error:
            raise SystemExit(f"cycle failed: {report.error}")
        if cycle >= 3:  # the first cycles register every job: measured from the fourth on
            durations.append(report.duration_s)
            records.append(report.records)
            waited.append(service.state.last_heartbeat() or {})
    durations.sort()
    p95 = durations[min(len(durations) - 1, round(0.95 * (len(durations) - 1)))]
    return [
        f"{count:,} x {RANKS_PER_JOB}",
        f"{statistics.median(records):,.0f}",
        f"{statistics.median(durations) * 1000:.0f} ms",
        f"{p95 * 1000:.0f} ms",
        f"{durations[-1] * 1000:.0f} ms",
        f"{sum(records) / sum(durations):,.0f}",
        f"{max(float(h.get('detection_wait_s', 0)) for h in waited):.0f} s",
    ]


if __name__ == "__main__":
    main()
