"""Hot path of StepReporter: nanoseconds per call on the training thread.

Compares ``record()`` and ``with rep.step()`` (three phases) with a naive synchronous XADD
per step against the same Redis. Run with the dev cluster up: ``python -m
benchmarks.bench_reporter``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import redis

from benchmarks._common import machine, redis_url, table
from slurm_plugin import StepReporter
from slurm_plugin.telemetry.store import TelemetryStore, connect


def _per_call_ns(fn: Callable[[], None], calls: int, batch: int = 1000) -> float:
    """Median over batches of the mean time per call, in ns."""
    samples = []
    for _ in range(calls // batch):
        started = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - started) / batch)
    return statistics.median(samples)


def main() -> None:
    url = redis_url()
    client = redis.Redis.from_url(url)
    client.delete("stg:job:{999001}:steps", "stg:job:{999002}:steps", "bench:naive")
    rep = StepReporter(
        "999001",
        0,
        "bench",
        store_factory=lambda: TelemetryStore(connect(url)),
        buffer_records=1_000_000,
    )
    step = [0]

    def record() -> None:
        rep.record(step[0], 0.1, 0.07, 0.02, 0.01)

    def stepped() -> None:
        with rep.step():
            with rep.phase("data"):
                pass
            with rep.phase("compute"):
                pass
            with rep.phase("comm"):
                pass

    def empty() -> None:
        return None

    def naive() -> None:
        client.xadd(
            "bench:naive",
            {
                "rank": "0",
                "step": "1",
                "step_s": "0.1",
                "compute_s": "0.07",
                "comm_s": "0.02",
                "data_s": "0.01",
            },
        )

    loop_ns = _per_call_ns(empty, 200_000)
    record_ns = _per_call_ns(record, 500_000) - loop_ns
    step_ns = _per_call_ns(stepped, 200_000) - loop_ns
    naive_ns = _per_call_ns(naive, 5_000, batch=100) - loop_ns
    rep.close()
    client.delete("stg:job:{999001}:steps", "stg:job:{999001}:events", "bench:naive")
    print(f"machine: {machine()}; redis: {url}")
    print(
        table(
            ["call on the training thread", "median ns/call", "vs naive XADD"],
            [
                [
                    "rep.record(step, step_s, compute, comm, data)",
                    f"{record_ns:,.0f}",
                    f"{naive_ns / record_ns:,.0f}x faster",
                ],
                [
                    "with rep.step(): + 3 x rep.phase()",
                    f"{step_ns:,.0f}",
                    f"{naive_ns / step_ns:,.0f}x faster",
                ],
                ["naive synchronous XADD per step", f"{naive_ns:,.0f}", "1x"],
            ],
        )
    )
    print(
        f"(loop overhead of {loop_ns:.0f} ns/call subtracted; published {rep.published:,} "
        f"records in the background, dropped {rep.dropped})"
    )


if __name__ == "__main__":
    main()
