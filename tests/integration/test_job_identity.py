"""Issue 25: a job id is not a job. The real Service, Executor, state and credentials over a
private redis-server, with FakeScheduler giving an id again (a controller reinstalled, or
MaxJobId wrapped): nothing of the old job is used for, or done to, the new one."""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from structlog.testing import capture_logs

from slurm_plugin.config import Settings
from slurm_plugin.errors import CommandTimeoutError, SlurmError
from slurm_plugin.health.hook import HookResult, _redis_prolog
from slurm_plugin.model import keys
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.policy.rails import SafetyPolicy
from slurm_plugin.service.identity import Known, fields_of, same_job, token
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store import credentials, registration
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.conftest import RedisServer, Slurm
from tests.integration.loop_harness import (
    NODES,
    Loop,
    held_job,
    make_loop,
    publish,
    running_job,
)

__all__ = ["make_loop"]  # the fixture, from loop_harness
pytestmark = pytest.mark.integration


def _evict(loop: Loop, job_id: str = "5", first_step: int = 0) -> None:
    """Cycles with node3 2x slow until the service has made a change to the job."""
    before = len(loop.slurm.changes)
    for cycle in range(30):
        job = loop.slurm.job_table[job_id]
        if job.running:
            start = first_step + cycle * 10
            publish(loop, job, range(start, start + 10), {"node3": 2.0})
        loop.service.cycle()
        loop.clock.advance(1)
        if any(c[0] == "release" for c in loop.slurm.changes[before:]):
            return
    pytest.fail(f"no eviction: {loop.slurm.changes[before:]}")


def _new_job(clock: FakeClock, user: str = "bob", **changes: object) -> JobInfo:
    """Job 5 again, but another job: submitted now, never requeued."""
    job = replace(running_job(clock, user=user), submit_time=clock() - 5)
    return replace(job, **changes)  # type: ignore[arg-type]


def test_identity_follows_requeues_and_tells_a_new_job_apart() -> None:
    clock = FakeClock()
    job = replace(running_job(clock), submit_time=1000.0)
    known = Known.of(fields_of(job, None))
    assert known is not None
    assert same_job(known, job)
    requeued = replace(job, submit_time=1300.0, restarts=1)  # Slurm moves it and counts
    assert same_job(known, requeued)
    assert not same_job(known, replace(job, user="mallory"))
    assert not same_job(known, replace(job, submit_time=5000.0))  # same id, never requeued
    later = Known.of(fields_of(requeued, known))
    assert later is not None
    assert later.first_submit_ts == 1000.0  # the token stays the job's across requeues
    assert not same_job(later, replace(job, restarts=0))


def test_a_new_job_with_an_old_id_inherits_nothing(make_loop: Callable[..., Loop]) -> None:
    """Repro: a new job 1 inherited the old job 1's eviction count and cooldown, so its own
    straggler was never evicted. Now the old state is closed and forgotten."""
    clock = FakeClock()
    slurm = FakeScheduler([replace(running_job(clock), submit_time=clock() - 700)], NODES)
    loop = make_loop(slurm, clock, "a")
    _evict(loop)
    assert loop.state.job("5")["evictions"] == "1"
    old_first = loop.state.job("5")["identity_first_submit_ts"]
    clock.advance(3600 * 2)
    slurm.job_table["5"] = _new_job(clock)  # the controller was reinstalled: ids from 1 again
    loop.service.cycle()
    kept = loop.state.job("5")
    assert kept.get("evictions") is None, kept
    assert kept.get("last_eviction_ts") is None, kept
    assert kept["identity_user"] == "bob"
    # Node history names jobs by id and first submit time: one id, two jobs, two names.
    assert token("5", float(kept["identity_first_submit_ts"])) != token("5", float(old_first))
    with capture_logs() as logs:
        _evict(loop, first_step=10_000)
    assert loop.state.job("5")["evictions"] == "1"
    assert not [e for e in logs if e["event"] == "service.steps_lost"]  # the old entries


def test_the_runs_unique_id_tells_a_new_job_apart_where_slurm_gives_one() -> None:
    """From Slurm 25.11 every run of a job has its SLUID (a requeue gives a new one): the
    run we saw is the job whatever its submit time reads; another run is the job only after a
    requeue (more restarts); an id Slurm gave again is another run without one."""
    clock = FakeClock()
    job = replace(running_job(clock), submit_time=1000.0, sluid="s8KHM8PARCN500")
    known = Known.of(fields_of(job, None))
    assert known is not None
    assert known.sluid == "s8KHM8PARCN500"
    assert same_job(known, replace(job, submit_time=1000.7))
    requeued = replace(job, submit_time=1300.0, restarts=1, sluid="s8KHM8PARFRZ00")
    assert same_job(known, requeued)
    # Another job with the id, submitted in the same second: the submit time cannot tell it
    # apart, its run can.
    assert not same_job(known, replace(job, sluid="s8KHM8PASPWD00"))
    later = Known.of(fields_of(requeued, known))
    assert later is not None
    assert later.sluid == "s8KHM8PARFRZ00"
    assert not same_job(later, replace(job, restarts=1, sluid="s8KHM8PAZZZZ00"))
    # A state written before the upgrade (no run kept) falls back to the submit time.
    older = Known.of({k: v for k, v in fields_of(job, None).items() if k != "identity_sluid"})
    assert older is not None
    assert older.sluid is None
    assert same_job(older, replace(job, sluid="s8KHM8PASPWD00"))


def test_recovery_never_acts_on_another_job_with_the_id(make_loop: Callable[..., Loop]) -> None:
    """Repro: recovery of the old job's half-done eviction set ExcNodeList on an unrelated
    held job with the same id and released its user hold."""
    clock = FakeClock()
    slurm = FakeScheduler([replace(running_job(clock), submit_time=clock() - 700)], NODES)
    loop = make_loop(slurm, clock, "a")
    timeout = SlurmError("scontrol timed out")
    timeout.__cause__ = CommandTimeoutError(["scontrol"], 3.0)
    slurm.fail["set_excluded"] = timeout
    _evict_until_held(loop)
    (open_decision,) = loop.state.open_decisions()
    assert open_decision["state"] == "held"
    # The old job is gone; the new job 5 of another user is held by that user.
    slurm.fail.clear()
    slurm.job_table["5"] = _new_job(
        clock, state="PENDING", reason="JobHeldUser", priority=0, nodes=()
    )
    changes = len(slurm.changes)
    for _ in range(3):
        loop.service.cycle()
        clock.advance(1)
    assert slurm.changes[changes:] == [], slurm.changes[changes:]
    assert slurm.job_table["5"].held
    decision = loop.state.decision(open_decision["id"])
    assert decision["state"] == "abandoned"
    assert "job id 5 is now another job (user bob" in decision["error"]
    assert not loop.state.open_decisions()


def test_recovery_never_acts_on_another_run_of_the_same_user(
    make_loop: Callable[..., Loop],
) -> None:
    """With Slurm's run ids (25.11 on) the user and submit time need not differ: a decision
    planned on one run whose requeuehold never landed (the service stopped) is abandoned when
    the id names a run it never saw, of the same user, submitted in the same second, never
    requeued; that job is never touched."""
    clock = FakeClock()
    first = replace(running_job(clock), submit_time=clock() - 700, sluid="s8KHM8PARCN500")
    slurm = FakeScheduler([first], NODES)
    loop = make_loop(slurm, clock, "a")
    timeout = SlurmError("scontrol timed out")
    timeout.__cause__ = CommandTimeoutError(["scontrol"], 3.0)
    slurm.fail["requeue_hold"] = timeout
    for cycle in range(30):
        publish(loop, slurm.job_table["5"], range(cycle * 10, cycle * 10 + 10), {"node3": 2.0})
        loop.service.cycle()
        loop.clock.advance(1)
        if loop.state.open_decisions():
            break
    (open_decision,) = loop.state.open_decisions()
    assert open_decision["state"] == "planned"
    assert loop.state.record(open_decision["id"]).job_sluid == "s8KHM8PARCN500"
    slurm.fail.clear()
    slurm.job_table["5"] = replace(first, sluid="s8KHM8PASPWD00")  # another job 5 of alice
    changes = len(slurm.changes)
    for _ in range(3):
        loop.service.cycle()
        clock.advance(1)
    assert slurm.changes[changes:] == [], slurm.changes[changes:]
    decision = loop.state.decision(open_decision["id"])
    assert decision["state"] == "abandoned", decision
    assert "is now another job" in decision["error"]


def _evict_until_held(loop: Loop) -> None:
    for cycle in range(30):
        job = loop.slurm.job_table["5"]
        if job.running:
            publish(loop, job, range(cycle * 10, cycle * 10 + 10), {"node3": 2.0})
        loop.service.cycle()
        loop.clock.advance(1)
        if loop.slurm.job_table["5"].held:
            return
    pytest.fail(f"never held: {loop.slurm.changes}")


def test_redis_that_forgot_is_bounded_by_slurms_restarts(make_loop: Callable[..., Loop]) -> None:
    """Repro: with Redis restarted empty a job was evicted past its max_requeues; Slurm's
    own Restarts count survived, and now bounds it."""
    clock = FakeClock()
    job = replace(running_job(clock), submit_time=clock() - 700, restarts=2)  # evict: max 2
    slurm = FakeScheduler([job], NODES)
    loop = make_loop(slurm, clock, "a")
    for cycle in range(20):
        publish(loop, slurm.job_table["5"], range(cycle * 10, cycle * 10 + 10), {"node3": 2.0})
        loop.service.cycle()
        clock.advance(1)
    assert [c for c in slurm.changes if c[0] == "requeue_hold"] == []
    assert loop.state.job("5")["evictions"] == "2"
    reasons = " ".join(d.get("reasons", "") for d in loop.state.job_decisions("5"))
    assert "already evicted 2 times (max 2)" in reasons, reasons


def test_redis_that_forgot_an_eviction_still_counts_it_in_the_hourly_budget(
    make_loop: Callable[..., Loop],
) -> None:
    """Redis restarted empty forgot two evictions of the last 10 minutes; Slurm still shows
    our mark on the requeued jobs (one running again, one still pending) and their SubmitTime
    (moved by the requeue). With a budget of two an hour, another job's straggler is not
    evicted; our eviction 2 hours ago is restored but outside the hour, and another
    deployment's is not ours to count."""
    clock = FakeClock()
    ours = "straggler: compute node4 +40.0% evicted [d-0123456789ab@a-site]"
    recent = replace(
        running_job(clock, job_id="6", nodes=("node4", "node5", "node6")),
        submit_time=clock() - 600,
        restarts=1,
        admin_comment=f"note | {ours}",
    )
    old = replace(
        recent,
        job_id="7",
        submit_time=clock() - 7200,
        admin_comment=ours.replace("0123456789ab", "0123456789ac"),
    )
    theirs = replace(
        recent, job_id="8", admin_comment=ours.replace("@a-site", "@b-site").replace("ab@", "ad@")
    )
    pending = replace(  # requeued 5 minutes ago, not running yet
        recent,
        job_id="9",
        state="PENDING",
        submit_time=clock() - 300,
        admin_comment=ours.replace("0123456789ab", "0123456789ae"),
    )
    job = running_job(clock)
    slurm = FakeScheduler([job, recent, old, theirs, pending], NODES)
    safety = SafetyPolicy(max_evictions_per_hour=2)
    loop = make_loop(slurm, clock, "a", deployment_id="a-site", safety=safety)
    with capture_logs() as logs:
        for cycle in range(20):
            publish(loop, slurm.job_table["5"], range(cycle * 10, cycle * 10 + 10), {"node3": 2.0})
            loop.service.cycle()
            clock.advance(1)
    restored = [e for e in logs if e["event"] == "service.eviction_restored"]
    assert sorted(e["decision_id"] for e in restored) == [
        "d-0123456789ab",
        "d-0123456789ac",
        "d-0123456789ae",
    ]
    assert loop.state.evictions_since(clock() - 3600) == 2  # not the other deployment's
    assert [c for c in slurm.changes if c[0] == "requeue_hold"] == []
    reasons = " ".join(d.get("reasons", "") for d in loop.state.job_decisions("5"))
    assert "eviction budget spent (2 in the last hour)" in reasons, reasons
    assert float(loop.state.job("6")["last_eviction_ts"]) == pytest.approx(recent.submit_time)


def test_a_credential_is_never_handed_to_another_user(private_redis: RedisServer) -> None:
    """Repro: a new job of another user received the old job's Redis password (SET NX on a
    key that outlived the job), and the old password could write into the new job's stream."""
    admin = redis.Redis.from_url(private_redis.url)
    first = credentials.issue(admin, "7", owner="1000")
    assert credentials.issue(admin, "7", owner="1000") == first  # the job's other nodes
    second = credentials.issue(admin, "7", owner="1001")  # another user's job 7
    assert second != first
    old = redis.Redis(port=private_redis.port, username=credentials.username("7"), password=first)
    with pytest.raises(redis.exceptions.AuthenticationError):
        old.xadd(keys.job_steps("7"), {"x": "1"})
    new = redis.Redis(port=private_redis.port, username=credentials.username("7"), password=second)
    assert new.xadd(keys.job_steps("7"), {"x": "1"})


def test_a_credential_belongs_to_one_run_where_slurm_names_runs(
    private_redis: RedisServer, tmp_path: Path
) -> None:
    """The limit docs/security.md stated: a later job of the *same* user given the same id
    while the old password's key lives (its epilog never ran) got the same password. From
    Slurm 25.11 the prolog binds the password to the run (SLURM_JOB_SLUID): every node of one
    run agrees on one password, another run gets another. Without a run id (older releases)
    the same user's job still gets the same one."""
    settings = Settings(
        redis={"url": private_redis.url},
        telemetry={"job_credentials": True, "job_credentials_dir": str(tmp_path)},
    )
    admin = redis.Redis.from_url(private_redis.url, decode_responses=True)

    def prolog(run: str | None) -> str:
        env = {"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "1000", "SLURM_JOB_GID": "1000"}
        env |= {"SLURM_JOB_SLUID": run} if run is not None else {}
        result = HookResult(node="node1", job_id="7")
        _redis_prolog(settings, env, result)
        assert not result.problems, result.problems
        path = credentials.credential_path("7", tmp_path)
        with path.open("rb") as handle:
            return str(tomllib.load(handle)["redis"]["url"])

    first = prolog("s8KHM8PARCN500")
    assert prolog("s8KHM8PARCN500") == first  # the run's other nodes
    assert registration.read(admin, "7").run == "s8KHM8PARCN500"
    second = prolog("s8KHM8PASPWD00")  # the same user's later job 7
    assert second != first
    assert str(admin.get(keys.job_credential("7"))).startswith("1000/s8KHM8PASPWD00:")
    assert prolog("s8KHM8PASPWD00; FLUSHALL") != second  # not a run id: bound to the uid
    assert registration.read(admin, "7").run == ""
    older = prolog(None)
    assert prolog(None) == older  # no run ids: the documented limit stands


def test_a_registration_never_lends_an_old_jobs_options(private_redis: RedisServer) -> None:
    """Repro: a new job inherited the old job's --straggler-* overrides from a registration
    that outlived it (the prolog merged into it)."""
    settings = Settings(redis={"url": private_redis.url})
    old = {"SLURM_JOB_ID": "9", "SPANK_STRAGGLER_MAX_REQUEUES": "0", "SLURM_JOB_USER": "alice"}
    _redis_prolog(settings, old, HookResult(node="node1", job_id="9"))
    admin = redis.Redis.from_url(private_redis.url, decode_responses=True)
    assert registration.read(admin, "9").options == {"max_requeues": "0"}
    new = {"SLURM_JOB_ID": "9", "SPANK_STRAGGLER_NOTIFY": "log", "SLURM_JOB_USER": "bob"}
    _redis_prolog(settings, new, HookResult(node="node1", job_id="9"))
    meta = registration.read(admin, "9")
    assert meta.options == {"notify": "log"}, meta  # no max_requeues inherited
    assert meta.user == "bob"


def test_on_the_cluster_an_old_half_done_eviction_never_touches_a_held_job(
    slurm: Slurm, job_dir: Path, state: ServiceState, env: dict[str, str]
) -> None:
    """The recovery repro on real Slurm and Redis: the decision an earlier job 1 left open
    (excluded, not yet released) meets a new job with that id, held by its user. The service
    abandons the decision; the job keeps its hold and gets no ExcNodeList."""
    from slurm_plugin.config import load_settings  # noqa: PLC0415
    from slurm_plugin.service.factory import build  # noqa: PLC0415
    from slurm_plugin.service.loop import Service  # noqa: PLC0415

    job = slurm.sbatch("--hold", "-N1", f"--output={job_dir / 'held-%j.log'}", "--wrap", "sleep 60")
    record = slurm.job(job)
    assert record["Priority"] == "0", record
    now = time.time()
    state.save_decision(  # what the old job's eviction left behind (its own user and time)
        "d-00000000abcd",
        {
            "state": "excluded",
            "action": "evict",
            "job_id": job,
            "node": "node3",
            "job_user": "someone-else",
            "job_submit_ts": f"{now - 86400 * 30:.0f}",
            "job_restarts": "0",
            "restarts_before": "0",
            "planned_at": f"{now - 5:.3f}",
            "held_at": f"{now - 4:.3f}",
        },
    )
    settings = load_settings()
    report = Service(settings, *build(settings)).cycle()
    assert report.error is None, report.error
    decision = state.decision("d-00000000abcd")
    assert decision["state"] == "abandoned", decision
    assert f"job id {job} is now another job" in decision["error"]
    after = slurm.job(job)
    assert after["Priority"] == "0", after  # still held by its user
    assert after.get("ExcNodeList", "(null)") in {"(null)", ""}, after


def test_a_second_deployment_never_undoes_the_firsts_marks(make_loop: Callable[..., Loop]) -> None:
    """Repro: two services on different Redis databases shared one Slurm without excluding
    each other, and one released the other's requeue-held job as an orphan. Marks now name
    their deployment: B leaves A's hold (and A's drain) alone; A, whose Redis lost the
    decision, releases its own orphan; a mark from before deployments had names is still
    taken for one's own."""
    clock = FakeClock()

    def held(job_id: str, tag: str) -> JobInfo:
        return held_job(clock, job_id, f"straggler: compute node3 +40.0% evict {tag}")

    drained = replace(
        NODES[2], flags=("DRAIN",), reason="straggler: persistent x [d-00000000dddd@aaaa]"
    )
    nodes = [*NODES[:2], drained, NODES[3]]
    jobs = [held("31", "[d-00000000aaaa@aaaa]"), held("32", "[d-00000000bbbb]")]
    slurm = FakeScheduler(jobs, nodes)
    b = make_loop(slurm, clock, "b", deployment_id="bbbb")
    assert b.service.cycle().error is None
    assert [c[:2] for c in slurm.changes] == [("release", "32")]  # the unnamed (legacy) mark
    assert slurm.job_table["31"].held
    assert not b.service.executor.resume_ours("node3", drained.reason, "d-00000000eeee")
    a = make_loop(slurm, clock, "a", deployment_id="aaaa")
    assert b.state.step_down("b")
    a.state.client.flushdb()  # A's Redis (the same server here) lost the decision
    assert a.service.cycle().error is None
    assert ("release", "31") in [c[:2] for c in slurm.changes]


def test_on_the_cluster_another_deployments_hold_is_left_alone(
    slurm: Slurm, job_dir: Path, state: ServiceState, env: dict[str, str]
) -> None:
    """The deployment repro on real Slurm and Redis: a job held with another deployment's
    eviction mark, whose decision this deployment's Redis does not know, stays held."""
    from slurm_plugin.config import load_settings  # noqa: PLC0415
    from slurm_plugin.service.factory import build  # noqa: PLC0415
    from slurm_plugin.service.loop import Service  # noqa: PLC0415

    job = slurm.sbatch("--hold", "-N1", f"--output={job_dir / 'held-%j.log'}", "--wrap", "sleep 60")
    mark = "straggler: compute node3 +40.0% evict [d-00000000aaaa@other-team]"
    slurm.run("scontrol", "update", f"JobId={job}", f"AdminComment={mark}")
    settings = load_settings()
    assert settings.deployment != "other-team"
    report = Service(settings, *build(settings)).cycle()
    assert report.error is None, report.error
    after = slurm.job(job)
    assert after["Priority"] == "0", after
    assert after["AdminComment"] == mark
    assert not [e for e in state.audit() if e.get("action") == "release"]
