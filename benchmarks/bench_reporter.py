"""Hot path of StepReporter: nanoseconds per call on the training thread.

Compares ``record()`` and ``with rep.step()`` (three phases) with a naive synchronous XADD
per step against the same Redis, and times ``record()`` again while the reporter's flusher
thread works without pause (it flushes every millisecond: packing and publishing hold the GIL
that the training thread needs). Run with the dev cluster up: ``python -m
benchmarks.bench_reporter``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import redis

from benchmarks._common import machine, redis_url, table
from slurm_plugin import StepReporter
from slurm_plugin.store.telemetry_store import TelemetryStore, connect


def _batches_ns(fn: Callable[[], None], calls: int, batch: int = 1000) -> list[float]:
    """The mean time per call of each batch of ``batch`` calls, in ns."""
    samples = []
    for _ in range(calls // batch):
        started = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - started) / batch)
    return samples


def _per_call_ns(fn: Callable[[], None], calls: int, batch: int = 1000) -> float:
    """Median over batches of the mean time per call, in ns."""
    return statistics.median(_batches_ns(fn, calls, batch))


def _busy_flusher(url: str, calls: int) -> tuple[float, float, int]:
    """``record()`` while the flusher never idles: median and p99 over batches of 100 calls
    (ns per call), and the records it published meanwhile."""
    busy = StepReporter(
        "999002",
        0,
        "bench",
        store_factory=lambda: TelemetryStore(connect(url)),
        buffer_records=1_000_000,
        flush_interval_s=0.001,
    )
    samples = []
    for batch in range(calls // 100):
        started = time.perf_counter_ns()
        for i in range(100):
            busy.record(batch * 100 + i, 0.1, 0.07, 0.02, 0.01)
        samples.append((time.perf_counter_ns() - started) / 100)
        time.sleep(0.0002)  # a training step is longer than a call: the flusher runs between
    samples.sort()
    busy.close()
    return statistics.median(samples), samples[int(len(samples) * 0.99)], busy.published


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
    busy_ns, busy_p99_ns, busy_entries = _busy_flusher(url, 200_000)
    client.delete(
        "stg:job:{999001}:steps",
        "stg:job:{999001}:events",
        "stg:job:{999002}:steps",
        "stg:job:{999002}:events",
        "bench:naive",
    )
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
                [
                    (
                        "rep.record() while the flusher flushes every 1 ms (p99 of batches: "
                        f"{busy_p99_ns:,.0f} ns; {busy_entries:,} records published)"
                    ),
                    f"{busy_ns:,.0f}",
                    f"{naive_ns / busy_ns:,.0f}x faster",
                ],
            ],
        )
    )
    print(
        f"(loop overhead of {loop_ns:.0f} ns/call subtracted; published {rep.published:,} "
        f"records in the background, dropped {rep.dropped})"
    )


if __name__ == "__main__":
    main()
