"""Ingest: records/s one redis-server takes from our reporters, and the memory it holds.

A. End to end: PROCS processes each host RANKS real StepReporters (one flusher thread each),
   record STEPS steps per rank as fast as they can; time until every record is in Redis.
B. Server capacity with our format: 2 processes send rank flushes of 10 records (what a rank
   at 10 steps/s sends each second), 16 flushes per pipeline, for 5 s.
C. ``redis-benchmark -P 16`` XADD of one small entry against the same server.

``python -m benchmarks.bench_ingest [PROCS RANKS STEPS]`` with the dev cluster up.
"""

from __future__ import annotations

import multiprocessing
import re
import subprocess
import sys
import time
from multiprocessing.synchronize import Event

import redis

from benchmarks._common import machine, redis_url, table
from slurm_plugin import StepReporter
from slurm_plugin.model import keys
from slurm_plugin.model.records import encode_steps
from slurm_plugin.store.telemetry_store import TelemetryStore, connect

JOB = "999100"
WORLD = 16_384


def _reporters(
    first: int,
    ranks: int,
    world: int,
    steps: int,
    url: str,
    start: Event,
    out: multiprocessing.Queue[int],
) -> None:
    reps = [
        StepReporter(
            JOB,
            first + r,
            f"n{(first + r) // 8}",
            r % 8,
            world_size=world,
            store_factory=lambda: TelemetryStore(connect(url)),
            flush_interval_s=0.25,
            buffer_records=steps + 1,
        )
        for r in range(ranks)
    ]
    start.wait()
    for step in range(steps):
        for rep in reps:
            rep.record(step, 0.1, 0.07, 0.02, 0.01)
    for rep in reps:
        rep.close(timeout_s=120)
    out.put(sum(rep.published for rep in reps))


def _flushes(
    first: int, url: str, seconds: float, start: Event, out: multiprocessing.Queue[int]
) -> None:
    store = TelemetryStore(connect(url))
    now = time.time()
    raws = [(s, now + s / 10, 0.1, 0.07, 0.02, 0.01) for s in range(10)]
    entries = [encode_steps(first + r, f"n{r // 8}", r % 8, 0, raws) for r in range(16)]
    maxlen = keys.steps_maxlen(WORLD)
    start.wait()
    sent = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        store.publish(JOB + "1", entries, steps_maxlen=maxlen)
        sent += len(entries) * len(raws)
    out.put(sent)


def _run(target: object, args_for: list[tuple[object, ...]]) -> tuple[int, float]:
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, start, out)) for a in args_for]  # type: ignore[arg-type]
    for p in procs:
        p.start()
    time.sleep(2.0)  # let every process set up
    began = time.perf_counter()
    start.set()
    total = sum(out.get(timeout=600) for _ in procs)
    elapsed = time.perf_counter() - began
    for p in procs:
        p.join()
    return total, elapsed


def _redis_benchmark(url: str) -> float:
    port = re.search(r":(\d+)", url.split("//", 1)[1])
    proc = subprocess.run(
        [
            "redis-benchmark",
            "-p",
            port.group(1) if port else "6379",
            "-q",
            "-n",
            "300000",
            "-P",
            "16",
            "XADD",
            "bench:rb",
            "MAXLEN",
            "~",
            "100000",
            "*",
            "f",
            "v",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    match = re.search(r"([\d.]+) requests per second", proc.stdout.replace("\r", "\n"))
    return float(match.group(1)) if match else float("nan")


def main() -> None:
    procs_n, ranks, steps = (int(a) for a in (sys.argv[1:4] or ["2", "64", "1000"]))
    url = redis_url()
    client = redis.Redis.from_url(url)
    cleanup = [*keys.job_keys(JOB), *keys.job_keys(JOB + "1"), "bench:rb"]
    client.delete(*cleanup)
    before = int(client.info("memory")["used_memory"])
    published, elapsed_a = _run(
        _reporters, [(p * ranks, ranks, procs_n * ranks, steps, url) for p in range(procs_n)]
    )
    memory_a = int(client.info("memory")["used_memory"]) - before
    sent, elapsed_b = _run(_flushes, [(0, url, 5.0), (16, url, 5.0)])
    entries_b = int(client.xlen(keys.job_steps(JOB + "1")))
    memory_b = int(client.info("memory")["used_memory"]) - before - memory_a
    rb = _redis_benchmark(url)
    client.delete(*cleanup)
    cap = keys.steps_maxlen(WORLD)
    print(f"machine: {machine()}; redis: {url}")
    print(
        table(
            ["measurement", "figure"],
            [
                [
                    f"A. end to end, {procs_n} processes x {ranks} reporters",
                    (
                        f"{published:,} records in {elapsed_a:.2f} s = "
                        f"{published / elapsed_a:,.0f} records/s"
                    ),
                ],
                ["A. Redis memory per record", f"{memory_a / max(published, 1):,.0f} B"],
                [
                    "B. server capacity, 10-record rank flushes, 16 per pipeline",
                    f"{sent / elapsed_b:,.0f} records/s ({sent / elapsed_b / 10:,.0f} flushes/s)",
                ],
                [
                    f"B. stream after B (cap {cap:,} entries for {WORLD:,} ranks)",
                    f"{entries_b:,} entries, {memory_b / 2**20:,.1f} MiB",
                ],
                ["C. redis-benchmark -P 16 XADD (1 small entry each)", f"{rb:,.0f} entries/s"],
            ],
        )
    )


if __name__ == "__main__":
    main()
