"""Leadership against a stalled or absent Slurm, without a cluster: two service instances over
one Redis (the lock and its fence), a leader that steps down after failing cycles, and cycles
that fail while slurmctld does not answer (never read as "no jobs")."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_plugin.errors import SlurmError
from slurm_plugin.model import keys
from slurm_plugin.store import credentials
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.conftest import acl_users, wait_for
from tests.integration.loop_harness import (
    NODES,
    Loop,
    make_loop,
    publish,
    run_cycles,
    running_job,
)

__all__ = ["make_loop"]  # the fixture, from loop_harness


class StallingScheduler(FakeScheduler):
    """With ``stall``, answers ``requeue_hold`` only when the test sets ``answer`` after doing
    it (a slow slurmctld: the test decides how slow, no clock races it); stamps every changing
    call with the monotonic time it was made."""

    def __init__(self, shared: FakeScheduler, *, stall: bool = False) -> None:
        super().__init__()
        self.job_table, self.node_table = shared.job_table, shared.node_table
        self.stall = stall
        self.stamps: list[tuple[float, str]] = []
        #: Set when a requeuehold starts to stall: the instance is stuck in Slurm now.
        self.stalling = threading.Event()
        #: Set by the test: slurmctld answers the stalled requeuehold.
        self.answer = threading.Event()

    def _call(self, name: str, *args: str) -> None:
        super()._call(name, *args)
        if name in {"requeue_hold", "set_excluded", "release", "annotate", "drain", "resume"}:
            self.stamps.append((time.monotonic(), name))

    def requeue_hold(self, job_id: str) -> None:
        super().requeue_hold(job_id)
        if self.stall:
            self.stalling.set()
            self.answer.wait(timeout=120)


def test_two_instances_never_both_act(make_loop: Callable[..., Loop], tmp_path: Path) -> None:
    """Issue 13 item 4: instance A's requeuehold answers only after its lock lapsed and B took
    over and finished the eviction; A, back from the stall, makes no further Slurm change (the
    fence) and cannot move the decision back (states only move forward)."""
    clock = FakeClock()
    shared = FakeScheduler([running_job(clock)], NODES)
    ttl = 1.0
    slow_a = StallingScheduler(shared, stall=True)
    b_slurm = StallingScheduler(shared)
    a = make_loop(slow_a, clock, "a", lock_ttl_s=ttl)
    b = make_loop(b_slurm, clock, "b", lock_ttl_s=ttl)
    reports = []
    for cycle in range(20):
        publish(a, shared.job_table["5"], range(cycle * 10, cycle * 10 + 10), {"node3": 2.0})
        worker = threading.Thread(target=lambda: reports.append(a.service.cycle()))
        worker.start()
        while worker.is_alive() and not slow_a.stalling.wait(0.05):
            pass
        if slow_a.stalling.is_set():  # A is stuck in its requeuehold: B runs its cycles meanwhile
            break
        clock.advance(1)
    else:
        pytest.fail("A never started an eviction")
    # A's lock lapses while it is stuck (its lifetime is real time); then B leads and
    # finishes the eviction, cycle after cycle, before A is back.
    wait_for(lambda: not a.state.client.exists(keys.LEADER), 10, "A's lock to lapse")

    def b_finished() -> bool:
        b.service.cycle()
        return [name for _, name in b_slurm.stamps] == ["set_excluded", "release", "annotate"]

    wait_for(b_finished, 30, "B to finish the eviction")
    assert worker.is_alive(), "A came back before slurmctld answered it"
    slow_a.answer.set()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert [name for _, name in slow_a.stamps] == ["annotate", "requeue_hold"]
    assert [name for _, name in b_slurm.stamps] == ["set_excluded", "release", "annotate"]
    last_of_a = max(t for t, _ in slow_a.stamps)
    assert last_of_a < min(t for t, _ in b_slurm.stamps)
    assert "not the leader" in (reports[-1].error or "")
    (decision,) = a.state.job_decisions("5")
    assert decision["state"] == "verified"
    job = shared.job_table["5"]
    assert (job.excluded, job.restarts) == (("node3",), 1)


def test_a_broken_leader_steps_down_for_a_good_standby(make_loop: Callable[..., Loop]) -> None:
    """Issue 18 item 3: instance A, whose every cycle fails (its Slurm answers nothing), leads
    first; after three failed cycles it gives the lock up and stands by, the good instance B
    takes over and evicts the straggler."""
    clock = FakeClock()
    shared = FakeScheduler([running_job(clock)], NODES)
    broken = FakeScheduler()
    broken.job_table, broken.node_table = shared.job_table, shared.node_table
    broken.fail["jobs"] = SlurmError(
        "squeue: slurm_load_jobs error: Unable to contact slurm controller"
    )
    a = make_loop(broken, clock, "a", lock_ttl_s=1.0)
    b = make_loop(shared, clock, "b", lock_ttl_s=1.0)
    reports = [a.service.cycle() for _ in range(3)]
    assert all(r.leader and r.error and "slurm controller" in r.error for r in reports)
    assert a.state.leads("a") is False
    for cycle in range(20):
        publish(b, shared.job_table["5"], range(cycle * 10, cycle * 10 + 10), {"node3": 2.0})
        assert not a.service.cycle().leader  # standing by
        assert b.service.cycle().leader
        clock.advance(1)
        if shared.job_table["5"].restarts:
            break
    assert shared.job_table["5"].excluded == ("node3",)


def test_slurm_unknown_is_not_no_jobs(make_loop: Callable[..., Loop]) -> None:
    """Issue 18 item 2: slurmctld does not answer for 30 s of cycles. The cycles fail; the
    running job's credential is not revoked, nothing is decided or changed, and its detection
    state is kept: once Slurm answers again, node3 (slow all along) is evicted without the
    detector starting over. Only Slurm's answer that the job is gone revokes the credential."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    # The lock's life is real time: the first cycle after the outage reads 30 cycles' steps
    # and must finish inside it on a loaded CI machine, or the fence (rightly) refuses to act.
    loop = make_loop(slurm, clock, "a", telemetry={"job_credentials": True}, lock_ttl_s=3.0)
    credentials.issue(loop.store.client, "5")
    run_cycles(loop, 0, 3, {"node3": 1.0})  # healthy steps: the detector is warm
    slurm.fail["jobs"] = SlurmError("squeue: Unable to contact slurm controller")
    for cycle in range(30):
        publish(loop, slurm.job_table["5"], range(30 + cycle, 31 + cycle), {"node3": 2.0})
        report = loop.service.cycle()  # fails, or stands by after three failures
        assert not report.leader or "slurm controller" in (report.error or "")
        loop.clock.advance(1)
    assert credentials.username("5") in acl_users(loop.store.client)
    assert slurm.changes == []
    assert loop.state.job_decisions("5") == []
    del slurm.fail["jobs"]
    wait_for(lambda: loop.service.cycle().leader, 30, "the instance to lead again")
    run_cycles(loop, 60, 5, {"node3": 2.0})
    assert slurm.job_table["5"].excluded == ("node3",)
    assert credentials.username("5") in acl_users(loop.store.client)
    del slurm.job_table["5"]  # gone from Slurm without an epilog: Slurm's answer revokes it
    clock.advance(31)
    assert loop.service.cycle().error is None
    assert credentials.username("5") not in acl_users(loop.store.client)
