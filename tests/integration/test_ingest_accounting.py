"""Issue 17 on a real redis-server: steps entries trimmed before the service read them are
counted (never lost silently), a backlog is read whole, and a flush stored twice is read once."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any, cast

import redis

from slurm_plugin.config import Settings
from slurm_plugin.detection import Detector
from slurm_plugin.model import keys
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.model.records import encode_steps
from slurm_plugin.service.ingest import Ingest
from slurm_plugin.service.metrics import Metrics
from slurm_plugin.service.policies import REGISTRATION_KEPT_S, PolicySet
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store import registration
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from slurm_plugin.telemetry.reporter import StepReporter
from slurm_plugin.testing import FakeClock
from tests.integration.conftest import RedisServer, wait_for
from tests.integration.loop_harness import running_job


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


def test_a_number_too_large_for_a_column_costs_one_entry_not_the_cycle(
    private_redis: RedisServer,
) -> None:
    """A job writes its own stream: one flush whose rank has 30 digits made the cycle's decode
    raise for every job read with it, and again each cycle (the cursor never moved past it)."""
    raw = redis.Redis.from_url(private_redis.url)
    store = TelemetryStore(raw)
    state = ServiceState(redis.Redis.from_url(private_redis.url, decode_responses=True))
    ingest = Ingest(state, store, Metrics())
    clock = FakeClock()
    hostile, other = running_job(clock, "5"), running_job(clock, "6")
    _publish(store, hostile, 0, 5, maxlen=10_000)
    bad = encode_steps(
        0, "node1", 0, 0, [(5, (hostile.start_time or 0) + 5, 0.1, 0.08, 0.01, 0.01)]
    )
    store.publish(hostile.job_id, [{**bad, "rank": "9" * 30}], steps_maxlen=10_000)
    _publish(store, hostile, 6, 4, maxlen=10_000)
    _publish(store, other, 0, 10, maxlen=10_000)
    detector = Detector()
    read = ingest.read([(hostile, detector), (other, detector)])
    assert {job_id: kept.records for job_id, (kept, _) in read.items()} == {"5": 9, "6": 10}
    assert state.job("5")["steps_read"] == "10"  # the bad entry is behind the cursor
    again = ingest.read([(hostile, detector), (other, detector)])
    assert [kept.records for kept, _ in again.values()] == [0, 0]


def test_an_event_with_a_number_no_job_reports_costs_one_event_not_the_cycle(
    private_redis: RedisServer,
) -> None:
    """A job's events stream holding a time of 400 digits (OverflowError) and one of 5,000
    (ValueError in the parser) failed every cycle for every job; they are malformed events,
    counted, and the other job's checkpoint is read."""
    raw = redis.Redis.from_url(private_redis.url)
    state = ServiceState(redis.Redis.from_url(private_redis.url, decode_responses=True))
    ingest = Ingest(state, TelemetryStore(raw), Metrics())
    clock = FakeClock()
    hostile, other = running_job(clock, "5"), running_job(clock, "6")
    for digits in (400, 5000):
        raw.xadd(
            keys.job_events("5"),
            {"json": '{"name": "checkpoint_end", "ts": 1' + "0" * digits + "}"},
        )
    raw.xadd(keys.job_events("6"), {"json": json.dumps({"name": "checkpoint_end", "ts": clock()})})
    detector = Detector()
    for _ in range(2):  # the cursor moved past them: the next cycle reads nothing again
        ingest.read([(hostile, detector), (other, detector)])
    assert state.job("5")["ignored_malformed_event"] == "2"
    assert state.job("5").get("last_checkpoint_ts") is None
    assert float(state.job("6")["last_checkpoint_ts"]) == clock()


def test_a_jobs_state_keeps_a_ttl_though_it_is_not_set_every_cycle(
    private_redis: RedisServer,
) -> None:
    """Each cycle writes every running job's cursors; the TTL goes with the first write and
    again after the state was dropped (an id Slurm gave another job), not with every write."""
    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    state = ServiceState(client)
    key = keys.job_service("5")
    state.update_jobs({"5": {"steps_cursor": "1-0"}})
    assert 0 < client.ttl(key) <= keys.JOB_TTL_ACTIVE_S
    client.config_resetstat()
    for cursor in range(2, 12):
        state.update_jobs({"5": {"steps_cursor": f"{cursor}-0"}, "6": {"steps_cursor": "1-0"}})
    calls = {name: stat["calls"] for name, stat in client.info("commandstats").items()}
    assert calls.get("cmdstat_expire") == 1  # job 6's first write; job 5's TTL stands
    assert 0 < client.ttl(keys.job_service("6")) <= keys.JOB_TTL_ACTIVE_S
    state.forget_job("5")
    state.update_jobs({"5": {"steps_cursor": "1-0"}})
    assert 0 < client.ttl(key) <= keys.JOB_TTL_ACTIVE_S


def _register(
    client: redis.Redis, job: JobInfo, policy: str, attempt: int, at: float = 1.8e9
) -> None:
    registration.register(
        client,
        job.job_id,
        registration.Registration(
            policy=policy, attempt=str(attempt), user=job.user, registered_at=f"{at:.3f}"
        ),
    )


def test_a_registration_is_kept_for_its_attempt_and_read_again_after_a_requeue(
    private_redis: RedisServer,
) -> None:
    """The prolog writes a job's registration once per attempt: the service keeps the one of
    the attempt Slurm runs (not read each cycle), reads it every cycle while the new attempt's
    prolog has not written yet, and again once the id is another job's or time has passed."""
    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    clock = FakeClock()
    settings = Settings(
        redis={"url": private_redis.url},
        service={"policy_dir": Path(__file__).resolve().parents[2] / "policies"},
    )
    policies = PolicySet(settings, ServiceState(client), clock=clock)
    policies.reload()
    job = running_job(clock, "5", policy="evict")

    def chosen(job: JobInfo) -> str:
        policies.prefetch([job])
        return policies.for_job(job).name

    _register(client, job, "observe", attempt=0)
    assert chosen(job) == "observe"
    _register(client, job, "evict", attempt=0)  # no prolog does this: shows it is kept
    assert chosen(job) == "observe"
    clock.advance(REGISTRATION_KEPT_S)
    assert chosen(job) == "evict"

    requeued = dataclasses.replace(job, restarts=1)
    assert chosen(requeued) == "evict"  # attempt 0's, read again each cycle meanwhile
    _register(client, requeued, "observe", attempt=1)  # the new attempt's prolog
    assert chosen(requeued) == "observe"

    _register(client, requeued, "evict", attempt=1)
    assert chosen(requeued) == "observe"
    policies.forget(job.job_id)  # Slurm gave the id to another job
    assert chosen(requeued) == "evict"

    # Written an hour before Slurm started this run (an earlier job's, whose prolog wrote
    # and this one's did not): read again every cycle, never kept.
    other = running_job(clock, "7", policy="evict")
    _register(client, other, "observe", attempt=0, at=(other.start_time or 0) - 3600)
    assert chosen(other) == "observe"
    _register(client, other, "evict", attempt=0, at=(other.start_time or 0) - 3600)
    assert chosen(other) == "evict"
