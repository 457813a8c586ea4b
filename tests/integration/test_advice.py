"""Advice before a requeue (issue 40, item 1), as the service carries it out over a real
Redis and a fake Slurm: under ``recovery = "advice"`` a job is first told which nodes to
leave (a record its own credential can read, nothing written to Slurm but our mark); its
report that it left them closes the decision with no requeue; advice ignored, or a report
that does not answer it, is requeued at the deadline as today. And the in-job watch
(``straggler leave-on-advice``) that stops a node's launcher when its node is advised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from slurm_plugin.model import keys
from slurm_plugin.store import advice, credentials, registration
from slurm_plugin.store.registration import Registration
from slurm_plugin.telemetry import leave
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.conftest import RedisServer
from tests.integration.loop_harness import EVICTION, NODES, Loop, run_cycles, running_job
from tests.integration.test_lifecycle_service import make_loop

__all__ = ["make_loop"]

DEADLINE_S = 120.0  # the shipped default of advice_deadline_s


def _advised(
    make_loop: Callable[..., Loop], options: dict[str, str]
) -> tuple[Loop, dict[str, Any]]:
    """Job 5 (3 nodes) registered with ``options``; node3 computes 2x slower until the
    service decides; returns the loop and the decision."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    registration.register(
        loop.store.client, "5", Registration(policy="evict", user="alice", options=options)
    )
    for cycle in range(30):
        run_cycles(loop, cycle * 10, 1, {"node3": 2.0})
        if loop.state.job_decisions("5"):
            break
    (decision,) = loop.state.job_decisions("5")
    return loop, decision


def _cycles(loop: Loop, first_step: int, seconds: float, slow: dict[str, float]) -> None:
    """Cycles over ``seconds`` of the clock, 10 steps a cycle."""
    cycles = max(1, int(seconds // 10))
    for cycle in range(cycles):
        run_cycles(loop, first_step + cycle * 10, 1, slow)
        loop.clock.advance(9)


def _job_client(loop: Loop, url: str) -> redis.Redis:
    """Connected as job 5's own ACL user (what its ranks and launcher use)."""
    password = credentials.issue(loop.store.client, "5")
    return redis.Redis.from_url(credentials.job_url(url, "5", password), decode_responses=True)


def test_a_job_that_leaves_the_node_itself_is_not_requeued(
    make_loop: Callable[..., Loop], private_redis: RedisServer
) -> None:
    """Advised, not requeued: the decision waits for ``advice`` (our mark on the job, no
    requeue), its advice names node3, the decision and its deadline and is readable with the
    job's own credential (which reads nothing else); the job's report that node3 left closes
    it as ``acted``, the advice withdrawn, and nothing is requeued, not even after the
    deadline."""
    loop, decision = _advised(make_loop, {"recovery": "advice"})
    assert (decision["action"], decision["state"], decision["nodes"]) == (
        "advise",
        "waiting",
        '["node3"]',
    ), decision
    assert [c[0] for c in loop.slurm.changes] == ["annotate"]
    assert decision["id"] in loop.slurm.changes[0][2]
    job = _job_client(loop, private_redis.url)
    given = advice.read(job, "5")
    assert given is not None
    assert (given.leave, given.decision_id) == (["node3"], decision["id"])
    assert given.deadline_ts == pytest.approx(given.issued_ts + DEADLINE_S)
    with pytest.raises(redis.exceptions.NoPermissionError):
        job.hgetall("stg:job:{5}:meta")
    with pytest.raises(redis.exceptions.NoPermissionError):
        job.set("stg:job:{5}:advice", "{}")  # read-only: a job never writes its own advice
    # node3 still slow while the job gets going: the deadline stands, nothing else happens.
    _cycles(loop, 300, 60, {"node3": 2.0})
    assert [c[0] for c in loop.slurm.changes] == ["annotate"]
    # The job leaves node3 and says so with its own credential.
    event = {
        "name": advice.ACTED,
        "ts": loop.clock(),
        **advice.acted_event(given.decision_id, "node3"),
    }
    job.xadd("stg:job:{5}:events", {"json": json.dumps(event)})
    _cycles(loop, 400, 20, {})
    (closed,) = loop.state.job_decisions("5")
    assert closed["state"] == "acted", closed
    assert "node3" in closed["note"]
    assert advice.read(loop.store.client, "5") is None
    assert loop.state.open_decisions() == []
    _cycles(loop, 500, 2 * DEADLINE_S, {})
    assert [c[0] for c in loop.slurm.changes] == ["annotate"]
    assert loop.slurm.job_table["5"].restarts == 0
    job.close()


@pytest.mark.parametrize(
    "answer",
    [None, ("d-000000000000", "node3"), ("same", "node2")],
    ids=["ignored", "another-decision", "another-node"],
)
def test_advice_not_acted_on_is_requeued_at_the_deadline(
    make_loop: Callable[..., Loop], answer: tuple[str, str] | None
) -> None:
    """A job that ignores its advice, or reports leaving for another decision or another
    node, is requeued without node3 at the deadline, as under ``requeue``; the eviction's
    record says so and the advice is withdrawn."""
    loop, decision = _advised(make_loop, {"recovery": "advice"})
    if answer is not None:
        decision_id = decision["id"] if answer[0] == "same" else answer[0]
        fields = advice.acted_event(decision_id, answer[1])
        loop.store.publish("5", events=[{"name": advice.ACTED, "ts": loop.clock(), **fields}])
    _cycles(loop, 300, DEADLINE_S - 20, {"node3": 2.0})
    assert [c[0] for c in loop.slurm.changes] == ["annotate"]
    _cycles(loop, 600, 40, {"node3": 2.0})
    assert [c[0] for c in loop.slurm.changes] == ["annotate", *EVICTION]
    (evicted,) = loop.state.job_decisions("5")
    assert (evicted["id"], evicted["action"], evicted["after"]) == (
        decision["id"],
        "evict",
        "advice deadline",
    )
    assert evicted["state"] == "verified"
    assert loop.slurm.job_table["5"].excluded == ("node3",)
    assert advice.read(loop.store.client, "5") is None


def test_without_advice_a_job_is_requeued_at_once(make_loop: Callable[..., Loop]) -> None:
    """The default (``recovery = "requeue"``, or the job's ``--straggler-recovery=requeue``):
    no advice, the eviction as before."""
    loop, decision = _advised(make_loop, {"recovery": "requeue"})
    assert decision["action"] == "evict"
    assert [c[0] for c in loop.slurm.changes] == EVICTION
    assert advice.read(loop.store.client, "5") is None


def _sleeper(tmp_path: Path) -> list[str]:
    """A launcher stand-in that writes its pid, then runs until stopped."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    return [sys.executable, "-c", code]


def test_the_watch_stops_the_advised_node_and_says_so(
    private_redis: RedisServer, tmp_path: Path
) -> None:
    """``straggler leave-on-advice``'s watch: the launcher runs until its node is advised;
    advice for another node or a past deadline changes nothing; then the launcher is
    stopped (its process gone), the node's leaving reported on the job's events with the
    job's own credential, and the watch exits 0."""
    admin = redis.Redis.from_url(private_redis.url, decode_responses=True)
    password = credentials.issue(admin, "6")
    job = redis.Redis.from_url(credentials.job_url(private_redis.url, "6", password))
    watch = leave.redis_watch("6", "node3", job, every_s=0.2)
    now = time.time()
    alive: list[bool] = []

    def advise(node: str, deadline: float) -> None:
        given = advice.Advice(
            job_id="6",
            decision_id="d-0123456789ab",
            leave=[node],
            reasons=["test"],
            issued_ts=now,
            deadline_ts=deadline,
        )
        advice.publish(admin, given)

    def script() -> None:
        """Advice for another node, then a past one: the launcher runs on; then node3's."""
        advise("node2", now + 60)
        time.sleep(1.0)
        advise("node3", now - 1)  # no longer holds
        time.sleep(1.0)
        try:  # the launcher still runs
            os.kill(int((tmp_path / "pid").read_text()), 0)
            alive.append(True)
        except (OSError, ValueError):
            alive.append(False)
        advise("node3", now + 60)

    adviser = threading.Thread(target=script)
    adviser.start()
    status, left = leave.run(watch, _sleeper(tmp_path))
    adviser.join()
    assert alive == [True]
    assert time.time() - now < 20
    pid = int((tmp_path / "pid").read_text())
    assert status == leave.LEFT
    assert left is not None
    assert left.decision_id == "d-0123456789ab"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    entries = cast("list[tuple[str, dict[str, str]]]", admin.xrange("stg:job:{6}:events"))
    reported = [json.loads(fields["json"]) for _, fields in entries]
    assert advice.acted_of(reported) == [("d-0123456789ab", "node3")]
    job.close()
    admin.close()


def test_the_watch_passes_the_launcher_status_through(
    private_redis: RedisServer,
) -> None:
    """A launcher that ends by itself: the watch exits with its status, reports nothing."""
    admin = redis.Redis.from_url(private_redis.url, decode_responses=True)
    watch = leave.redis_watch("8", "node1", admin, every_s=0.2)
    assert leave.run(watch, [sys.executable, "-c", "raise SystemExit(3)"]) == (3, None)
    assert admin.xlen("stg:job:{8}:events") == 0
    done = subprocess.run(  # the command line: one line, no traceback, without a command
        [sys.executable, "-m", "slurm_plugin.cli.main", "leave-on-advice", "--job", "8"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    admin.close()


def test_withdrawing_takes_only_the_named_decisions_advice(private_redis: RedisServer) -> None:
    """``advice.withdraw`` deletes the job's advice only while it is the named decision's, in
    one step: a newer advice of another decision, and a record that is not JSON, stay."""
    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    now = time.time()

    def given(decision_id: str) -> advice.Advice:
        return advice.Advice(
            job_id="7",
            decision_id=decision_id,
            leave=["node3"],
            issued_ts=now,
            deadline_ts=now + DEADLINE_S,
        )

    advice.publish(client, given("dec-aaaaaa"))
    advice.publish(client, given("dec-bbbbbb"))  # a newer decision's advice replaced it
    assert advice.withdraw(client, "7", "dec-aaaaaa") is False
    assert advice.read(client, "7") == given("dec-bbbbbb")
    assert advice.withdraw(client, "7", "dec-bbbbbb") is True
    assert advice.read(client, "7") is None
    assert advice.withdraw(client, "7", "dec-bbbbbb") is False  # nothing left: no error
    key = keys.job_advice("7")
    client.set(key, "not json")
    assert advice.withdraw(client, "7", "dec-bbbbbb") is False
    assert client.get(key) == "not json"
