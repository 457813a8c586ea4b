"""Issue 17 on a real redis-server: steps entries trimmed before the service read them are
counted (never lost silently), a backlog is read whole, and a flush stored twice is read once."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import redis

from slurm_plugin.detection import Detector
from slurm_plugin.model import keys
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.model.records import encode_steps
from slurm_plugin.service.ingest import Ingest
from slurm_plugin.service.metrics import Metrics
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from slurm_plugin.telemetry.reporter import StepReporter
from slurm_plugin.testing import FakeClock
from tests.integration.conftest import RedisServer, wait_for
from tests.integration.test_control_loop import running_job


def _publish(store: TelemetryStore, job: JobInfo, first: int, entries: int, maxlen: int) -> None:
    """``entries`` flushes of one step each from rank 0 on node1, the stream capped at about
    ``maxlen`` (Redis trims whole stream nodes of 100 entries), stamped from the job's start."""
    start = job.start_time or 0.0
    batches = [
        encode_steps(0, "node1", 0, 0, [(step, start + step, 0.1, 0.08, 0.01, 0.01)])
        for step in range(first, first + entries)
    ]
    store.publish(job.job_id, batches, steps_maxlen=maxlen)


def _asleep(url: str) -> bool:
    """Redis does not answer a PING within 50 ms (it is in DEBUG SLEEP)."""
    probe = redis.Redis.from_url(url, socket_timeout=0.05, socket_connect_timeout=0.05)
    try:
        probe.ping()
    except redis.TimeoutError:
        return True
    finally:
        probe.close()
    return False


def test_entries_trimmed_before_they_were_read_are_counted(private_redis: RedisServer) -> None:
    """Read 100 entries; then 1,000 more arrive into a stream capped at ~200: the next read
    catches up with what is left and counts the rest as lost; reading again adds nothing."""
    raw = redis.Redis.from_url(private_redis.url)
    store = TelemetryStore(raw)
    state = ServiceState(redis.Redis.from_url(private_redis.url, decode_responses=True))
    ingest = Ingest(state, store, Metrics())
    job = running_job(FakeClock())
    detector = Detector()

    _publish(store, job, 0, 100, maxlen=10_000)
    ingest.steps(job, detector)
    assert state.job(job.job_id).get("steps_lost") is None
    assert state.job(job.job_id)["steps_read"] == "100"

    _publish(store, job, 100, 1000, maxlen=200)
    left = raw.xlen(keys.job_steps(job.job_id))
    assert left < 1000  # Redis trimmed the stream, unread entries included
    ingest.steps(job, detector)
    known = state.job(job.job_id)
    # Every entry ever added was either read or counted lost; at most `left` were still there.
    assert int(known["steps_lost"]) == 1100 - int(known["steps_read"])
    assert int(known["steps_read"]) <= 100 + left
    assert int(known["steps_lost"]) >= 1000 - left

    ingest.steps(job, detector)  # nothing new: nothing more lost
    assert state.job(job.job_id)["steps_lost"] == known["steps_lost"]
    _publish(store, job, 1100, 10, maxlen=10_000)
    ingest.steps(job, detector)
    assert state.job(job.job_id)["steps_lost"] == known["steps_lost"]
    assert int(state.job(job.job_id)["steps_read"]) == int(known["steps_read"]) + 10


def test_a_backlog_larger_than_the_old_cap_is_read_in_one_cycle(
    private_redis: RedisServer,
) -> None:
    """150,000 entries waiting (a 75k-rank job after one 2 s cycle): one cycle reads them all
    (the fixed cap was 100,000 entries per job per cycle) and nothing is counted lost."""
    raw = redis.Redis.from_url(private_redis.url)
    store = TelemetryStore(raw)
    state = ServiceState(redis.Redis.from_url(private_redis.url, decode_responses=True))
    ingest = Ingest(state, store, Metrics())
    job = running_job(FakeClock())
    for first in range(0, 150_000, 10_000):
        _publish(store, job, first, 10_000, maxlen=1_000_000)
    kept, _ = ingest.steps(job, Detector())
    known = state.job(job.job_id)
    assert known["steps_read"] == "150000"
    assert known.get("steps_lost") is None
    assert kept.records == 150_000


def test_a_flush_redis_stored_before_the_client_gave_up_is_read_once(
    private_redis: RedisServer,
) -> None:
    """Issue 17: Redis stalls (DEBUG SLEEP 2) past the reporter's 0.5 s timeout while a
    flush waits in its socket; Redis then stores it, the reporter retries it and it is in the
    stream twice. The retry is the same entries (same flush ids), so the service and `export`
    read every step once and count the repeats."""
    private_redis.stop()
    private_redis.start("--enable-debug-command", "local")
    url = private_redis.url
    reporter = StepReporter(
        "5",
        0,
        "node1",
        store_factory=lambda: TelemetryStore(connect(url, timeout_s=0.5, retries=0)),
        flush_interval_s=0.2,
        backoff_s=(0.2, 0.5),
    )
    admin = redis.Redis.from_url(url)
    try:
        for step in range(50):
            reporter.record(step, 0.1, compute_s=0.08)
        assert reporter.flush(timeout_s=5)
        stall = threading.Thread(
            target=lambda: cast("Any", redis.Redis.from_url(url)).execute_command(
                "DEBUG", "SLEEP", "2"
            )
        )
        stall.start()
        # Redis is asleep (a PING goes unanswered): the next flush times out after it was sent.
        wait_for(lambda: _asleep(url), 5, "Redis to go to sleep")
        for step in range(50, 100):
            reporter.record(step, 0.1, compute_s=0.08)
        stall.join()
        assert reporter.flush(timeout_s=10)
    finally:
        reporter.close(timeout_s=5)
    stream = keys.job_steps("5")
    entries = cast("list[tuple[bytes, dict[bytes, bytes]]]", admin.xrange(stream))
    steps = [
        int(line.split()[0]) for _, fields in entries for line in fields[b"steps"].split(b"\n")
    ]
    assert len(steps) > 100, "no flush was stored twice: the stall did not hit a flush"

    state = ServiceState(redis.Redis.from_url(url, decode_responses=True))
    ingest = Ingest(state, TelemetryStore(admin), Metrics())
    # The reporter stamped its steps with the real clock: the job started before them.
    kept, _ = ingest.steps(running_job(FakeClock(time.time())), Detector())
    assert kept.records == 100
    assert int(state.job("5")["steps_repeats"]) >= 1
    exported = sorted(r.step for r in TelemetryStore(admin).iter_steps("5"))
    assert exported == list(range(100))
