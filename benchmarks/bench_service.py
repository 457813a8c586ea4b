"""Service cycle time with 1,000 ranks publishing (10 steps/s each, one flush per second).

The Slurm side is a static stand-in (1,000 ranks on 125 nodes cannot run on this machine);
Redis, the telemetry path, detection and the decision path are the real ones. Run with the dev
cluster up, against an empty Redis database (it refuses any other):
``STRAGGLER_REDIS_URL=redis://127.0.0.1:16379/14 python -m benchmarks.bench_service``.
At the end it deletes the keys it wrote (the database was empty before), never anything else.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import clear, empty_redis, machine, table
from slurm_plugin.config import Settings
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.model.records import encode_steps
from slurm_plugin.service.loop import Service
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store.telemetry_store import TelemetryStore, connect

RANKS, PER_NODE, JOB = 1000, 8, "424242"
NODES = [f"gpu{i:03d}" for i in range(RANKS // PER_NODE)]


class StaticScheduler:
    """One running job on 125 nodes; records what the service asks of Slurm."""

    def __init__(self, job_id: str = JOB, nodes: Sequence[str] = tuple(NODES)) -> None:
        self.calls: list[str] = []
        self.node_names = list(nodes)
        self._job = JobInfo(
            job_id,
            "bench",
            "RUNNING",
            "None",
            tuple(nodes),
            (),
            0,
            True,
            "straggler:policy=observe",
            "",
            "gpu",
            len(nodes),
            "bench",
            4 * 3600.0,
            time.time() - 60,
        )

    def jobs(self) -> list[JobInfo]:
        return [self._job]

    def job(self, job_id: str) -> JobInfo:
        return self._job

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo(n, "allocated", (), "", ("gpu",)) for n in self.node_names]

    def requeue_hold(self, job_id: str) -> None:
        self.calls.append("requeue_hold")

    def hold_reason(self, job_id: str) -> str:
        return ""  # never held: the benchmark's job keeps running

    def set_excluded(self, job_id: str, nodes: Sequence[str]) -> None:
        self.calls.append("set_excluded")

    def release(self, job_id: str) -> None:
        self.calls.append("release")

    def annotate(self, job_id: str, text: str) -> None:
        self.calls.append("annotate")

    def drain(self, node: str, reason: str) -> None:
        self.calls.append("drain")

    def resume(self, node: str) -> None:
        self.calls.append("resume")


def main() -> None:
    url, client = empty_redis()
    try:
        run(url)
    finally:
        clear(client)


def run(url: str) -> None:
    store = TelemetryStore(connect(url))
    settings = Settings(
        redis={"url": url}, service={"policy_dir": Path(__file__).resolve().parents[1] / "policies"}
    )
    scheduler = StaticScheduler()
    service = Service(settings, scheduler, ServiceState(connect(url, decode=True)), store)
    step, cycles, records = 0, [], []
    t0 = time.time()
    for second in range(40):
        entries = []
        for rank in range(RANKS):
            slow = 1.06 if (rank == 333 and second >= 20) else 1.0
            raws = [
                (
                    step + s,
                    t0 + second + s / 10,
                    0.1,
                    0.07 * slow * (1 + 0.01 * ((rank * 7 + s * 13) % 11 - 5) / 5),
                    0.02,
                    0.01,
                )
                for s in range(10)
            ]
            entries.append(encode_steps(rank, NODES[rank // PER_NODE], rank % PER_NODE, 0, raws))
        store.publish(JOB, entries)
        step += 10
        report = service.cycle()
        if report.error:
            raise SystemExit(f"cycle failed: {report.error}")
        cycles.append(report.duration_s)
        records.append(report.records)
        if report.events:
            found = [(e["kind"], e.get("node"), e.get("ranks")) for e in report.events]
            print(f"second {second}: {found}")
    print(f"machine: {machine()}")
    print(
        table(
            ["measurement", "figure"],
            [
                [
                    "ranks x steps per cycle",
                    f"{RANKS} x 10 ({statistics.median(records):,.0f} records)",
                ],
                [
                    "service cycle (median / max)",
                    f"{statistics.median(cycles) * 1000:.0f} ms / {max(cycles) * 1000:.0f} ms",
                ],
                ["Slurm calls made (observe policy)", ", ".join(scheduler.calls) or "none"],
            ],
        )
    )


if __name__ == "__main__":
    main()
