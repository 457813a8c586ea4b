"""Redis behind Sentinel, for real: two redis-server (master, replica) and three Sentinels on
loopback; the master killed while ranks publish and in the middle of an eviction."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from slurm_plugin.demo.run import start_service
from slurm_plugin.detection import Detector
from slurm_plugin.model import keys
from slurm_plugin.model.batch import RecordBatch
from slurm_plugin.service.ingest import Ingest
from slurm_plugin.service.metrics import Metrics
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store import credentials
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from slurm_plugin.telemetry.reporter import StepReporter
from slurm_plugin.testing import FakeClock
from tests.integration._sentinel import SentinelSet
from tests.integration.cluster_jobs import submit
from tests.integration.conftest import SERVICE_LOG, Slurm, acl_users, wait_cycles, wait_for
from tests.integration.loop_harness import running_job

pytestmark = pytest.mark.integration

RANKS = 4


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    topology = SentinelSet(tmp_path / "sentinel")
    topology.start()
    yield topology
    topology.stop()


class _Seen(Detector):
    """The detector, noting every (rank, step) the service believed."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: set[tuple[int, int]] = set()

    def add(self, job_id: str, batch: RecordBatch) -> None:
        self.steps.update(zip(batch.rank.tolist(), batch.step.tolist(), strict=True))
        super().add(job_id, batch)


def _missing_runs(steps: set[tuple[int, int]], recorded: int) -> tuple[int, int]:
    """Steps recorded but never believed, and how many unbroken runs they form."""
    lost = runs = 0
    for rank in range(RANKS):
        have = np.zeros(recorded, dtype=bool)
        have[[s for r, s in steps if r == rank]] = True
        lost += int((~have).sum())
        runs += int(np.count_nonzero(np.diff(np.concatenate(([1], have.astype(int)))) == -1))
    return lost, runs


def test_ranks_publish_through_a_failover_and_the_loss_is_counted(
    sentinels: SentinelSet, record_property: Callable[[str, object], None]
) -> None:
    """Four ranks flush every 50 ms through the Sentinel URL; the master is SIGKILLed. The
    reporters find the new master by themselves, the service reads on from it, and every step
    a rank recorded is either believed or in a flush the service counts as missing."""
    url = sentinels.url
    reporters = [
        StepReporter(
            "77",
            rank,
            f"node{rank + 1}",
            store_factory=lambda: TelemetryStore(connect(url, timeout_s=0.5, retries=0)),
            flush_interval_s=0.05,
            backoff_s=(0.1, 0.3),
        )
        for rank in range(RANKS)
    ]
    state = ServiceState(connect(url, decode=True, retries=0, timeout_s=0.5))
    ingest = Ingest(state, TelemetryStore(connect(url, retries=0, timeout_s=0.5)), Metrics())
    seen = _Seen()
    # Its ranks stamp their steps with the real clock: the job started before them.
    nodes = tuple(f"node{r + 1}" for r in range(RANKS))
    job = running_job(FakeClock(time.time()), job_id="77", nodes=nodes)
    done, step = threading.Event(), [0]

    def publish() -> None:
        while not done.is_set():
            for reporter in reporters:
                reporter.record(step[0], 0.01, compute_s=0.008, comm_s=0.002)
            step[0] += 1
            time.sleep(0.005)

    def read(until: float) -> int:
        failed = 0
        while time.monotonic() < until:
            try:
                ingest.steps(job, seen)
            except redis.RedisError:
                failed += 1  # the master is gone and no other is named yet
            time.sleep(0.1)
        return failed

    publisher = threading.Thread(target=publish)
    publisher.start()
    try:
        read(time.monotonic() + 1.5)
        old = sentinels.master_port()
        killed = sentinels.kill_master()
        promoted = sentinels.wait_failover(old)
        failed = read(time.monotonic() + 2.0)
    finally:
        done.set()
        publisher.join()
        for reporter in reporters:
            assert reporter.flush(timeout_s=10), "a rank could not publish after the failover"
            reporter.close()
    read(time.monotonic() + 0.5)
    recorded = step[0]
    lost, runs = _missing_runs(seen.steps, recorded)
    missing = int(state.job("77").get("steps_missing", "0"))
    record_property("failover_s", round(promoted - killed, 2))
    record_property("steps_recorded", recorded * RANKS)
    record_property("steps_lost", lost)
    record_property("flushes_missing", missing)
    assert all(r.dropped == 0 for r in reporters)
    # Every step after the failover reached the service; what the dead master took with it is
    # counted: no loss without a missing flush, and each lost run is at least one flush.
    assert (lost == 0) == (missing == 0), (lost, missing)
    assert runs <= missing <= lost
    assert promoted - killed < 10
    record_property("reads_failed", failed)


def test_a_jobs_credential_works_on_the_promoted_master(sentinels: SentinelSet) -> None:
    """ACL users are per server: the job's user is made on the replica too, so its ranks can
    still publish once the replica is the master."""
    admin = connect(sentinels.url)
    password = credentials.issue(admin, "88", owner="1000")
    replica = next(s for s in sentinels.servers if s.port != sentinels.master_port())
    assert credentials.username("88") in acl_users(redis.Redis(port=replica.port))
    old = sentinels.master_port()
    sentinels.kill_master()
    sentinels.wait_failover(old)
    job = TelemetryStore(connect(credentials.job_url(sentinels.url, "88", password), retries=0))
    wait_for(lambda: _publishes(job), 10, "the job's user to publish to the new master")
    credentials.revoke(connect(sentinels.url), "88")
    assert credentials.username("88") not in acl_users(redis.Redis(port=replica.port))


def _await_plan(watch: redis.Redis, job: str, timeout_s: float) -> float:
    """Block on the decisions stream until the service plans the job's eviction; returns when
    (the master is killed right after: mid-eviction, before Slurm's requeue is recorded)."""
    deadline, after = time.monotonic() + timeout_s, "$"
    while time.monotonic() < deadline:
        answer: Any = watch.xread({keys.DECISIONS: after}, block=1000)
        for _, entries in answer or []:
            for entry_id, fields in entries:
                after = entry_id
                ours = fields.get("job_id") == job and fields.get("action") == "evict"
                if ours and fields.get("state") == "planned":
                    return time.monotonic()
    raise AssertionError(f"the service planned no eviction of job {job} in {timeout_s} s")


def _publishes(store: TelemetryStore) -> bool:
    try:
        store.client.xadd(keys.job_steps("88"), {"probe": "1"})
    except redis.RedisError:
        return False
    return True


def test_the_master_dies_mid_eviction(
    sentinels: SentinelSet,
    slurm: Slurm,
    job_dir: Path,
    env: dict[str, str],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    record_property: Callable[[str, object], None],
) -> None:
    """The service, the CLI and the job's ranks all speak to Redis through the Sentinels. The
    master is killed the moment the eviction's plan is written: the service leads again on the
    new master and finishes the eviction (requeued once, node3 excluded) or, when Slurm was
    never asked, abandons the plan; never requeued twice, never left held."""
    env = {**env, "STRAGGLER_REDIS_URL": sentinels.url}
    monkeypatch.setenv("STRAGGLER_REDIS_URL", sentinels.url)  # what sbatch hands the job
    request.node.stash[SERVICE_LOG] = tmp_path / "service.log"
    proc, log = start_service(env, tmp_path / "service.log")
    state = ServiceState(connect(sentinels.url, decode=True))
    try:
        old = sentinels.master_port()
        watch = redis.Redis(port=old, decode_responses=True)
        job = submit(slurm, job_dir, "evict")
        slurm.wait_job(job, "RUNNING")
        planned = _await_plan(watch, job, timeout_s=180)
        killed = sentinels.kill_master()  # the plan is written; Slurm not yet (or just) asked
        promoted = sentinels.wait_failover(old)
        record = slurm.wait_job(job, "RUNNING", timeout_s=120)
        back = time.monotonic()
        wait_cycles(state, 3, timeout_s=60)  # the service cycles (leads) on the new master
        # ... and finishes what it planned before the kill: recovery first waits out the
        # plan's grace to learn whether Slurm was asked (three cycles can come sooner).
        wait_for(lambda: not state.open_decisions(), 120, "the planned eviction to finish")
        # A plan abandoned (the kill came before the requeuehold) may be decided anew once the
        # job's next report comes: let that one finish too, and read the job and its decisions
        # only between two moments with nothing open and no new decision.
        wait_cycles(state, 2, timeout_s=60)
        seen: list[Any] = []

        def settled() -> bool:
            before = state.job_decisions(job)
            if state.open_decisions():
                return False
            seen[:] = [slurm.job(job), before]
            return not state.open_decisions() and len(state.job_decisions(job)) == len(before)

        wait_for(settled, 120, "a new eviction to finish")
        record, everything = seen
        decisions = [d for d in everything if d.get("action") in {"evict", "release"}]
        record_property("plan_to_kill_ms", round((killed - planned) * 1000, 1))
        record_property("failover_s", round(promoted - killed, 2))
        record_property("kill_to_running_s", round(back - killed, 1))
        record_property("decisions", [(d.get("action"), d.get("state")) for d in decisions])
        assert decisions, "the audit lost the eviction and did not record a rollback"
        assert record["Restarts"] in {"0", "1"}, "the job was requeued more than once"
        assert record.get("Priority") != "0", f"the job was left held: {record}"
        evicted = [d for d in decisions if d.get("action") == "evict" and d["state"] == "verified"]
        if evicted:  # Slurm was asked before the kill: the eviction went through, once
            assert record["Restarts"] == "1"
            assert "node3" not in slurm.job_nodes(job)
        else:  # the kill came before the requeuehold: nothing was done, nothing to undo
            assert record["Restarts"] == "0", decisions
            assert "abandoned" in {d["state"] for d in decisions}, decisions
    finally:
        proc.kill()
        proc.wait()
        log.close()
        slurm.cancel_all()
