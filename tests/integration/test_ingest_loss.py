"""Issue 17, never lose silently: steps entries trimmed from a job's stream before the service
read them are counted (job state, log, metric), on a real redis-server."""

from __future__ import annotations

import redis

from slurm_plugin.detection import Detector
from slurm_plugin.service.ingest import Ingest
from slurm_plugin.service.metrics import Metrics
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm.model import JobInfo
from slurm_plugin.telemetry import keys
from slurm_plugin.telemetry.records import encode_steps
from slurm_plugin.telemetry.store import TelemetryStore
from slurm_plugin.testing import FakeClock
from tests.integration.conftest import RedisServer
from tests.integration.test_control_loop import running_job


def _publish(store: TelemetryStore, job: JobInfo, first: int, entries: int, maxlen: int) -> None:
    """``entries`` flushes of one step each from rank 0 on node1, the stream capped at about
    ``maxlen`` (Redis trims whole stream nodes of 100 entries)."""
    batches = [
        encode_steps(0, "node1", 0, 0, [(step, 1e9 + step, 0.1, 0.08, 0.01, 0.01)])
        for step in range(first, first + entries)
    ]
    store.publish(job.job_id, batches, steps_maxlen=maxlen)


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
