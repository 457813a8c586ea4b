"""The control loop's harness: the real Service, executor, state and telemetry store on a
private redis-server, with slurm_plugin.testing's FakeScheduler and FakeClock; the jobs, the
telemetry and the cycles the service tests drive it with."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis

from slurm_plugin.config import Settings
from slurm_plugin.detection import DetectionParams, Detector
from slurm_plugin.model.cluster import REQUEUE_HELD, JobInfo, NodeInfo
from slurm_plugin.model.records import encode_steps
from slurm_plugin.service.loop import Service
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store.telemetry_store import TelemetryStore
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.conftest import RedisServer, copy_policies

NODES = [NodeInfo(f"node{i}", "idle", (), "", ("debug",)) for i in range(1, 5)]
#: The Slurm changes of one eviction: our mark, requeuehold, exclusion, release, the mark
#: now "evicted".
EVICTION = ["annotate", "requeue_hold", "set_excluded", "release", "annotate"]


def running_job(
    clock: FakeClock,
    job_id: str = "5",
    policy: str = "evict",
    user: str = "alice",
    nodes: tuple[str, ...] = ("node1", "node2", "node3"),
) -> JobInfo:
    """A requeueable 3-node job, 10 minutes into a 4-hour limit."""
    return JobInfo(
        job_id=job_id,
        name="train",
        state="RUNNING",
        reason="None",
        nodes=nodes,
        excluded=(),
        restarts=0,
        requeue=True,
        comment=f"straggler:policy={policy}",
        admin_comment="",
        partition="debug",
        node_count=3,
        user=user,
        time_limit_s=4 * 3600.0,
        start_time=clock() - 600,
        priority=1,
    )


def held_job(
    clock: FakeClock, job_id: str, admin_comment: str, restarts: int = 1, **changes: Any
) -> JobInfo:
    """``running_job`` as Slurm shows it after our requeuehold: pending, held, marked with
    ``admin_comment``."""
    return replace(
        running_job(clock, job_id),
        state="PENDING",
        reason=REQUEUE_HELD,  # as scontrol says it of our requeuehold
        priority=0,
        nodes=(),
        restarts=restarts,
        admin_comment=admin_comment,
        **changes,
    )


@dataclass
class Loop:
    """One service instance over shared Redis."""

    service: Service
    slurm: FakeScheduler
    clock: FakeClock
    store: TelemetryStore
    state: ServiceState


def publish(
    loop: Loop,
    job: JobInfo,
    steps: range,
    slow: dict[str, float],
    groups: dict[str, str] | None = None,
) -> None:
    """Two ranks per node; ranks on a node of ``slow`` compute that many times longer and the
    others wait for them (the pattern of a real straggler); ``groups`` labels a node's ranks
    with a peer group."""
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
            group = (groups or {}).get(node, "")
            batches.append(encode_steps(2 * index + local, node, local, job.restarts, raws, group))
    loop.store.publish(job.job_id, batches)


@pytest.fixture
def make_loop(private_redis: RedisServer, tmp_path: Path) -> Iterator[Callable[..., Loop]]:
    """Builds service instances sharing one Redis and one fake Slurm (the shipped policies,
    each slowdown taken for a fault: :func:`copy_policies`)."""
    clients: list[redis.Redis] = []
    shipped = copy_policies(tmp_path / "shipped-policies")

    def make(
        slurm: FakeScheduler,
        clock: FakeClock,
        name: str,
        lock_ttl_s: float = 10,
        dry_run: bool = False,
        policy_dir: Path = shipped,
        detector: Callable[[DetectionParams], Detector] = Detector,
        **settings_values: Any,
    ) -> Loop:
        text = redis.Redis.from_url(private_redis.url, decode_responses=True)
        raw = redis.Redis.from_url(private_redis.url)
        clients.extend([text, raw])
        table = {"policy_dir": policy_dir, "interval_s": 1, **settings_values.pop("service", {})}
        settings = Settings(**settings_values, service=table)
        state = ServiceState(text, clock)
        store = TelemetryStore(raw)
        service = Service(
            settings,
            slurm,
            state,
            store,
            clock=clock,
            instance=name,
            lock_ttl_s=lock_ttl_s,
            dry_run=dry_run,
            detector=detector,
        )
        return Loop(service, slurm, clock, store, state)

    yield make
    for client in clients:
        client.close()


def run_cycles(
    loop: Loop,
    first: int,
    cycles: int,
    slow: dict[str, float],
    steps: int = 10,
    jobs: tuple[str, ...] = ("5",),
) -> None:
    """``cycles`` service cycles, each after ``steps`` steps of every job of ``jobs`` from step
    ``first`` on (:func:`publish`, ``slow`` as there), the clock a second on after each."""
    for cycle in range(cycles):
        start = first + cycle * steps
        for job_id in jobs:
            publish(loop, loop.slurm.job_table[job_id], range(start, start + steps), slow)
        loop.service.cycle()
        loop.clock.advance(1)


def flag_while_waiting_for_a_checkpoint(loop: Loop) -> None:
    """Job 5 reports checkpoints; node3 computes 2x slower until the service flags it and the
    decision waits for the next checkpoint (the last one is 10 minutes old: losing its work
    costs more than waiting for the next)."""
    checkpoint = {"name": "checkpoint_end", "ts": loop.clock() - 600, "step": 0}
    loop.store.publish("5", events=[checkpoint])
    for cycle in range(30):
        run_cycles(loop, cycle * 10, 1, {"node3": 2.0})
        if loop.state.job_decisions("5"):
            break
    assert [d["state"] for d in loop.state.job_decisions("5")] == ["waiting"]


NO_REQUEUE = """
description = "an evicting policy that may not requeue: only the node rails act"
[actions]
persistent_prior = 0.99  # a fault, as in copy_policies
mode = "evict"
when = "now"
max_requeues = 0
"""
