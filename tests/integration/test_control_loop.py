"""The control loop without a cluster: the real Service, executor, state and telemetry store on
a private redis-server, with slurm_plugin.testing's FakeScheduler and FakeClock."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from slurm_plugin.config import Settings
from slurm_plugin.service.loop import Service
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm.model import JobInfo, NodeInfo
from slurm_plugin.telemetry.records import encode_steps
from slurm_plugin.telemetry.store import TelemetryStore
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.conftest import REPO, RedisServer

NODES = [NodeInfo(f"node{i}", "idle", (), "", ("debug",)) for i in range(1, 5)]


def running_job(clock: FakeClock, job_id: str = "5", policy: str = "evict") -> JobInfo:
    """A requeueable 3-node job, 10 minutes into a 4-hour limit."""
    return JobInfo(
        job_id=job_id,
        name="train",
        state="RUNNING",
        reason="None",
        nodes=("node1", "node2", "node3"),
        excluded=(),
        restarts=0,
        requeue=True,
        comment=f"straggler:policy={policy}",
        admin_comment="",
        partition="debug",
        node_count=3,
        user="alice",
        time_limit_s=4 * 3600.0,
        start_time=clock() - 600,
        priority=1,
    )


@dataclass
class Loop:
    """One service instance over shared Redis."""

    service: Service
    slurm: FakeScheduler
    clock: FakeClock
    store: TelemetryStore
    state: ServiceState


def publish(loop: Loop, job: JobInfo, steps: range, slow: dict[str, float]) -> None:
    """Two ranks per node; ranks on a node of ``slow`` compute that many times longer and the
    others wait for them (the pattern of a real straggler)."""
    rng = random.Random(len(steps))  # noqa: S311 - measurement noise, not cryptography
    worst = max([1.0, *slow.values()])
    batches = []
    for index, node in enumerate(job.nodes):
        for local in range(2):
            raws = []
            for step in steps:
                compute = 0.05 * slow.get(node, 1.0) * (1 + 0.01 * rng.gauss(0, 1))
                step_s = 0.05 * worst + 0.01
                ts = loop.clock() - (steps.stop - step) * step_s
                raws.append((step, ts, step_s, compute, step_s - compute, 0.001))
            batches.append(encode_steps(2 * index + local, node, local, job.restarts, raws))
    loop.store.publish(job.job_id, batches)


@pytest.fixture
def make_loop(private_redis: RedisServer) -> Iterator[Callable[..., Loop]]:
    """Builds service instances sharing one Redis and one fake Slurm."""
    clients: list[redis.Redis] = []

    def make(slurm: FakeScheduler, clock: FakeClock, name: str, lock_ttl_s: float = 10) -> Loop:
        text = redis.Redis.from_url(private_redis.url, decode_responses=True)
        raw = redis.Redis.from_url(private_redis.url)
        clients.extend([text, raw])
        settings = Settings(policy_dir=REPO / "policies", service_interval_s=1)
        state = ServiceState(text, clock)
        store = TelemetryStore(raw)
        service = Service(
            settings, slurm, state, store, clock=clock, instance=name, lock_ttl_s=lock_ttl_s
        )
        return Loop(service, slurm, clock, store, state)

    yield make
    for client in clients:
        client.close()


def test_the_loop_evicts_a_real_straggler(make_loop: Callable[..., Loop]) -> None:
    """The harness itself: node3 computing 2x slower is detected, the job requeued without it
    (requeuehold, ExcNodeList, release) and the decision verified."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    for cycle in range(20):
        publish(loop, slurm.job_table["5"], range(cycle * 10, cycle * 10 + 10), {"node3": 2.0})
        loop.service.cycle()
        clock.advance(1)
        if slurm.changes:
            break
    assert [c[0] for c in slurm.changes] == ["annotate", "requeue_hold", "set_excluded", "release"]
    job = slurm.job_table["5"]
    assert (job.excluded, job.restarts, "node3" in job.nodes) == (("node3",), 1, False)
    (decision,) = loop.state.job_decisions("5")
    assert decision["state"] == "verified"


class StallingScheduler(FakeScheduler):
    """Answers ``requeue_hold`` only ``stall_s`` after doing it (a slow slurmctld) and stamps
    every changing call with the monotonic time it was made."""

    def __init__(self, shared: FakeScheduler, stall_s: float = 0.0) -> None:
        super().__init__()
        self.job_table, self.node_table = shared.job_table, shared.node_table
        self.stall_s = stall_s
        self.stamps: list[tuple[float, str]] = []

    def _call(self, name: str, *args: str) -> None:
        super()._call(name, *args)
        if name in {"requeue_hold", "set_excluded", "release", "annotate", "drain", "resume"}:
            self.stamps.append((time.monotonic(), name))

    def requeue_hold(self, job_id: str) -> None:
        super().requeue_hold(job_id)
        time.sleep(self.stall_s)


def test_two_instances_never_both_act(make_loop: Callable[..., Loop], tmp_path: Path) -> None:
    """Issue 13 item 4: instance A's requeuehold answers after 3x the lock's lifetime; B takes
    over meanwhile and finishes the eviction; A, back from the stall, makes no further Slurm
    change (the fence) and cannot move the decision back (states only move forward)."""
    clock = FakeClock()
    shared = FakeScheduler([running_job(clock)], NODES)
    ttl = 1.0
    slow_a = StallingScheduler(shared, stall_s=3 * ttl)
    b_slurm = StallingScheduler(shared)
    a = make_loop(slow_a, clock, "a", lock_ttl_s=ttl)
    b = make_loop(b_slurm, clock, "b", lock_ttl_s=ttl)
    reports = []
    for cycle in range(20):
        publish(a, shared.job_table["5"], range(cycle * 10, cycle * 10 + 10), {"node3": 2.0})
        worker = threading.Thread(target=lambda: reports.append(a.service.cycle()))
        worker.start()
        worker.join(timeout=0.5)
        if worker.is_alive():  # A is stuck in its requeuehold: B runs its cycles meanwhile
            break
        clock.advance(1)
    else:
        pytest.fail("A never started an eviction")
    time.sleep(ttl * 1.2)
    for _ in range(6):
        b.service.cycle()
        time.sleep(0.2)
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert [name for _, name in slow_a.stamps] == ["annotate", "requeue_hold"]
    assert [name for _, name in b_slurm.stamps] == ["set_excluded", "release"]
    last_of_a = max(t for t, _ in slow_a.stamps)
    assert last_of_a < min(t for t, _ in b_slurm.stamps)
    assert "not the leader" in (reports[-1].error or "")
    (decision,) = a.state.job_decisions("5")
    assert decision["state"] == "verified"
    job = shared.job_table["5"]
    assert (job.excluded, job.restarts) == (("node3",), 1)


def _run(loop: Loop, first: int, cycles: int, slow: dict[str, float], steps: int = 10) -> None:
    for cycle in range(cycles):
        start = first + cycle * steps
        publish(loop, loop.slurm.job_table["5"], range(start, start + steps), slow)
        loop.service.cycle()
        loop.clock.advance(1)


def test_one_waiting_decision_and_max_wait_is_honoured(make_loop: Callable[..., Loop]) -> None:
    """Issue 13 item 5: a job that reports checkpoints gets one waiting decision however often
    the straggler is seen again; its clock is not reset, so after max_wait_s (900 s) without a
    checkpoint the job is evicted (still slow), counted before acting, nothing left open."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    loop.store.publish("5", events=[{"name": "checkpoint_end", "ts": clock() - 60, "step": 0}])
    _run(loop, 0, 60, {"node3": 2.0})
    decisions = loop.state.job_decisions("5")
    assert [d["state"] for d in decisions] == ["waiting"]
    assert slurm.changes == []
    clock.advance(900)
    _run(loop, 600, 2, {"node3": 2.0})
    (decision,) = loop.state.job_decisions("5")
    assert (decision["state"], decision["after"]) == ("verified", "max wait")
    assert [c[0] for c in slurm.changes] == ["requeue_hold", "set_excluded", "release"]
    assert loop.state.job("5")["evictions"] == "1"
    assert loop.state.open_decisions() == []


def test_a_burst_that_is_over_is_not_evicted(make_loop: Callable[..., Loop]) -> None:
    """Issue 13 item 5: node3 is 2x slow for a while and then as fast as its peers before the
    job's next checkpoint; after the checkpoint the service re-checks the newest steps and
    records "recovered, not evicted" instead of requeueing the job."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    loop.store.publish("5", events=[{"name": "checkpoint_end", "ts": clock() - 60, "step": 0}])
    for cycle in range(30):
        _run(loop, cycle * 10, 1, {"node3": 2.0})
        if loop.state.job_decisions("5"):
            break
    assert [d["state"] for d in loop.state.job_decisions("5")] == ["waiting"]
    _run(loop, 400, 5, {})  # the burst is over
    loop.store.publish("5", events=[{"name": "checkpoint_end", "ts": clock(), "step": 440}])
    _run(loop, 450, 1, {})
    (decision,) = loop.state.job_decisions("5")
    assert decision["state"] == "recorded"
    assert "recovered, not evicted" in decision["reasons"]
    assert [c[0] for c in slurm.changes if c[0] != "annotate"] == []
    assert loop.state.job("5").get("evictions", "0") == "0"
