"""Load: 16,384 simulated ranks publishing 1 step/s each for 5 minutes while the service runs.

A producer process publishes, every second, one steps entry per rank (what a real reporter
sends at 1 step/s with its 1 s flush), to a private redis-server started here. The service
(real Service, real Redis, real detection; the static Slurm stand-in of bench_service) cycles
every ``--interval`` seconds (default 2, the service's default) in this process. One GPU
(rank 5000) computes 10 % slower from minute two on; everything else is healthy. Printed:
cycle time, how far the service lagged behind, Redis memory against the stream cap, and the
decisions taken.

Usage: ``python -m benchmarks.bench_load [--seconds 300] [--ranks 16384] [--interval 2]
[--relayed]`` (``--relayed``: the entries node relays write, one per node and second).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from benchmarks._common import machine, table
from benchmarks.bench_service import StaticScheduler
from slurm_plugin.config import Settings
from slurm_plugin.model import keys
from slurm_plugin.model.records import decode_header, encode_steps
from slurm_plugin.model.relayed import encode_relayed
from slurm_plugin.service.loop import Service
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store.telemetry_store import TelemetryStore, connect

JOB, PER_NODE, SLOW_RANK, SLOW_FROM_S = "515151", 8, 5000, 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def produce(
    url: str,
    ranks: int,
    seconds: float,
    start: float,
    published: Any,
    relayed: bool,
    slow_from: float,
) -> None:
    """Publish one step per rank per second until ``seconds`` have passed; counts the
    records Redis accepted in ``published`` (a shared integer). ``relayed``: one entry per
    node and second packing its ranks' flushes, what node relays write."""
    store = TelemetryStore(connect(url, timeout_s=10))
    rng = random.Random(7)  # noqa: S311 - noise, not cryptography
    step = 0
    while (now := time.time()) < start + seconds:
        published.value += publish_step(store, ranks, step, now - start >= slow_from, rng, relayed)
        step += 1
        time.sleep(max(0.0, start + step - time.time()))


def publish_step(
    store: TelemetryStore, ranks: int, step: int, slow: bool, rng: random.Random, relayed: bool
) -> int:
    """One step of every rank, stamped now; the records Redis accepted."""
    now = time.time()
    entries = []
    for rank in range(ranks):
        factor = 1.10 if slow and rank == SLOW_RANK else 1.0
        compute = 0.7 * factor * (1 + 0.01 * rng.gauss(0, 1))
        raw = (step, now, 1.0, compute, 1.0 - compute, 0.01)
        entries.append(encode_steps(rank, f"gpu{rank // PER_NODE:05d}", rank % 8, 0, [raw]))
    records = [1] * len(entries)  # one record per entry here
    if relayed:
        nodes = range(0, len(entries), PER_NODE)
        entries = [
            encode_relayed(
                f"gpu{i // PER_NODE:05d}",
                [decode_header(e) for e in entries[i : i + PER_NODE]],
                f"{i // PER_NODE:016x}.{step}",
            )
            for i in nodes
        ]
        records = [len(range(i, min(i + PER_NODE, ranks))) for i in nodes]
    maxlen = keys.steps_maxlen(ranks, 1.0)
    for i in range(0, len(entries), 4096):
        store.publish(JOB, entries[i : i + 4096], steps_maxlen=maxlen)
    return sum(records)


def run_alone(
    service: Service, admin: redis.Redis, url: str, args: argparse.Namespace
) -> tuple[Observed, int]:
    """The service alone: before each cycle, publish ``interval`` steps of every rank at once
    (not timed), then time the cycle; the slow GPU from step ``slow_from`` on."""
    store = TelemetryStore(connect(url, timeout_s=10))
    rng = random.Random(7)  # noqa: S311 - noise, not cryptography
    seen, published, step, start = Observed(), 0, 0, time.time()
    while step < args.seconds:
        for _ in range(int(args.interval)):
            slow = step >= args.slow_from
            published += publish_step(store, args.ranks, step, slow, rng, args.relayed)
            step += 1
        observed = run_service(service, admin, start, time.time() + 0.001, 0.0)
        seen.cycles += observed.cycles
        seen.records += observed.records
        seen.events += observed.events
        seen.memory += observed.memory
        seen.lengths += observed.lengths
        seen.lag_ms += observed.lag_ms
    return seen, published


@dataclass
class Observed:
    """What the service loop saw."""

    cycles: list[float] = field(default_factory=list)
    records: int = 0
    memory: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    lag_ms: list[int] = field(default_factory=list)
    events: list[tuple[float, str, object]] = field(default_factory=list)


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A private, empty redis-server without persistence; returns it and its URL."""
    port = _free_port()
    server = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            *("--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
            *("--dir", str(workdir)),
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    client.close()
    return server, url


def run_service(
    service: Service, admin: redis.Redis, start: float, until: float, interval: float
) -> Observed:
    """Cycle like `straggler serve` until ``until``; after every cycle sample how far the
    service is behind the stream, Redis memory and the stream's length; event times are
    seconds since the producer's ``start``."""
    seen = Observed()
    while time.time() < until:
        began = time.time()
        report = service.cycle()
        if report.error:
            print(f"cycle error: {report.error}")
        seen.cycles.append(report.duration_s)
        seen.records += report.records
        seen.events += [(began - start, str(e.get("node")), e.get("ranks")) for e in report.events]
        if not admin.exists(keys.job_steps(JOB)):  # nothing published yet
            time.sleep(max(0.0, interval - (time.time() - began)))
            continue
        seen.memory.append(int(admin.info("memory")["used_memory"]))
        seen.lengths.append(int(admin.xlen(keys.job_steps(JOB))))
        last = admin.xinfo_stream(keys.job_steps(JOB))["last-generated-id"]
        cursor = service.state.job(JOB).get("steps_cursor", "0-0")
        seen.lag_ms.append(int(last.decode().split("-")[0]) - int(cursor.split("-")[0]))
        time.sleep(max(0.0, interval - (time.time() - began)))
    return seen


def report(
    seen: Observed,
    args: argparse.Namespace,
    base_memory: int,
    calls: list[str],
    published: int,
    lost: int,
) -> str:
    """The figures as a Markdown table."""
    ordered = sorted(seen.cycles)
    median, p95 = statistics.median(ordered), ordered[int(len(ordered) * 0.95)]
    slow_node = f"gpu{SLOW_RANK // PER_NODE:05d}"
    mib = [(m - base_memory) / 2**20 for m in seen.memory]
    found = "; ".join(f"t={t:.0f} s {n} ranks {r}" for t, n, r in seen.events) or "none"
    return table(
        ["measurement", "figure"],
        [
            ["ranks x rate x duration", f"{args.ranks:,} x 1 step/s x {args.seconds:.0f} s"],
            ["entries", "one per node and second (relayed)" if args.relayed else "one per rank"],
            [
                "publisher",
                "none while a cycle runs (each cycle's steps written first)"
                if args.service_alone
                else "a concurrent process at 1 step/s",
            ],
            ["service interval", f"{args.interval:g} s"],
            ["records published / ingested", f"{published:,} / {seen.records:,}"],
            ["steps entries lost (trimmed before read)", f"{lost:,}"],
            [
                "service cycle median / p95 / max",
                f"{median * 1000:.0f} / {p95 * 1000:.0f} / {ordered[-1] * 1000:.0f} ms",
            ],
            ["service lag behind the stream (max)", f"{max(seen.lag_ms) / 1000:.1f} s"],
            ["Redis memory above empty (last / peak)", f"{mib[-1]:.0f} / {max(mib):.0f} MiB"],
            [
                "steps stream length (max) vs cap",
                f"{max(seen.lengths):,} vs ~{keys.steps_maxlen(args.ranks, 1.0):,}",
            ],
            ["detections", found],
            [
                f"slow GPU (rank {SLOW_RANK}, {slow_node}) +10 % from t={args.slow_from:.0f} s",
                "found" if any(n == slow_node for _, n, _ in seen.events) else "NOT found",
            ],
            ["Slurm calls (observe policy)", ", ".join(sorted(set(calls))) or "none"],
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--ranks", type=int, default=16_384)
    parser.add_argument("--interval", type=float, default=2.0, help="service_interval_s")
    parser.add_argument(
        "--relayed",
        action="store_true",
        help="publish as node relays do: one entry per node and second (8 ranks each)",
    )
    parser.add_argument(
        "--slow-from", type=float, default=SLOW_FROM_S, help="seconds (steps) before the slow GPU"
    )
    parser.add_argument(
        "--service-alone",
        action="store_true",
        help="no concurrent publisher: each cycle's steps are written first, then the cycle "
        "is timed (--seconds counts steps; for loads the publisher cannot make here)",
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="straggler-load-"))
    server, url = start_redis(workdir)
    admin = redis.Redis.from_url(url)
    base_memory = int(admin.info("memory")["used_memory"])
    scheduler = StaticScheduler(JOB, [f"gpu{i:05d}" for i in range(args.ranks // PER_NODE)])
    settings = Settings(
        redis={"url": url},
        service={
            "policy_dir": Path(__file__).resolve().parents[1] / "policies",
            "interval_s": args.interval,
        },
    )
    service = Service(
        settings, scheduler, ServiceState(connect(url, decode=True)), TelemetryStore(connect(url))
    )
    start = time.time() + 1.0
    published = mp.Value("q", 0)
    producer = mp.Process(
        target=produce,
        args=(url, args.ranks, args.seconds, start, published, args.relayed, args.slow_from),
    )
    if not args.service_alone:
        producer.start()
    try:
        if args.service_alone:
            seen, published.value = run_alone(service, admin, url, args)
        else:
            seen = run_service(service, admin, start, start + args.seconds + 2, args.interval)
        lost = int(service.state.job(JOB).get("steps_lost", "0") or 0)
    finally:
        if producer.is_alive():
            producer.join(timeout=30)
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"machine: {machine()}")
    print(report(seen, args, base_memory, scheduler.calls, int(published.value), lost))


if __name__ == "__main__":
    main()
