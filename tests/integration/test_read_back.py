"""Issue 25: the audit agrees with Slurm. Drains, resumes and orphan releases are read back
from Slurm, an unknown outcome is re-checked (never "failed" while it is unknown), and open
decisions close. The real Executor and ServiceState over a private redis-server, with
slurm_plugin.testing's FakeScheduler (timeouts that land or not, calls that do nothing)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import redis

from slurm_plugin.errors import CommandTimeoutError, SlurmError
from slurm_plugin.model.cluster import HOLD_UNCLEAR, JobInfo
from slurm_plugin.service.executor import Executor
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.conftest import RedisServer
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

GRACE = 60.0


def _timeout() -> SlurmError:
    error = SlurmError("scontrol update: timed out after 3 s")
    error.__cause__ = CommandTimeoutError(["scontrol"], 3.0)
    return error


class Flaky(FakeScheduler):
    """``effect[call]``: what a changing call does. "lands": takes effect then times out;
    "lost": times out without effect; "nothing": answers OK and changes nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.effect: dict[str, str] = {}

    def _flaky(self, name: str, real: Callable[[], None]) -> None:
        how = self.effect.pop(name, "")
        if how in {"lands", ""}:
            real()
        else:
            self.calls.append((name, "(no effect)"))
        if how in {"lands", "lost"}:
            raise _timeout()

    def drain(self, node: str, reason: str) -> None:
        self._flaky("drain", lambda: super(Flaky, self).drain(node, reason))

    def resume(self, node: str) -> None:
        self._flaky("resume", lambda: super(Flaky, self).resume(node))

    def release(self, job_id: str) -> None:
        self._flaky("release", lambda: super(Flaky, self).release(job_id))

    def annotate(self, job_id: str, text: str) -> None:
        self._flaky("annotate", lambda: super(Flaky, self).annotate(job_id, text))


@pytest.fixture
def setup(private_redis: RedisServer) -> Iterator[tuple[Executor, Flaky, ServiceState, FakeClock]]:
    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    clock = FakeClock()
    slurm = Flaky([], NODES)
    state = ServiceState(client, clock)
    executor = Executor(slurm, state, clock=clock, unknown_grace_s=GRACE, deployment="aaaa")
    yield executor, slurm, state, clock
    client.close()


def _reason(decision_id: str) -> str:
    return marks.reason("persistent", "node3 slow in 3 jobs", decision_id, "aaaa")


@pytest.mark.parametrize(
    ("effect", "first", "final"),
    [
        pytest.param("", "verified", "verified", id="drained"),
        pytest.param("nothing", "failed", "failed", id="answered-without-effect"),
        pytest.param("lands", "pending", "verified", id="timed-out-then-landed"),
        pytest.param("lost", "pending", "abandoned", id="timed-out-never-landed"),
    ],
)
def test_a_drain_is_what_slurm_shows(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock], effect: str, first: str, final: str
) -> None:
    """Repro: a drain that did nothing was recorded verified; one that landed after a timeout
    was failed while the node stayed drained with our mark."""
    executor, slurm, state, clock = setup
    slurm.effect["drain"] = effect
    decision_id = marks.new_decision_id()
    assert executor.drain(decision_id, "node3", _reason(decision_id)) == first
    if first == "pending":
        assert state.decision(decision_id)["state"] == "planned"
        assert "outcome unknown" in state.decision(decision_id)["error"]
        executor.recover()  # within the grace: still unknown unless Slurm shows it
        clock.advance(GRACE + 1)
        executor.recover()
    decision = state.decision(decision_id)
    assert decision["state"] == final, decision
    assert slurm.node_table["node3"].drained == (final == "verified")
    assert not state.open_decisions()


def test_a_drain_planned_before_a_crash_is_closed_from_slurm(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock],
) -> None:
    """Repro: a crash before the call left a drain planned forever (status showed it open)."""
    executor, slurm, state, clock = setup
    never, landed = marks.new_decision_id(), marks.new_decision_id()
    for decision_id in (never, landed):
        state.save_decision(
            decision_id,
            {
                "state": "planned",
                "action": "drain",
                "node": "node3" if decision_id == landed else "node2",
                "planned_at": f"{clock():.3f}",
            },
        )
    FakeScheduler.drain(slurm, "node3", _reason(landed))  # the call went out, then the crash
    executor.recover()
    assert state.decision(landed)["state"] == "verified"
    assert state.decision(never)["state"] == "planned"  # may still land: within the grace
    clock.advance(GRACE + 1)
    executor.recover()
    assert state.decision(never)["state"] == "abandoned"
    assert not state.open_decisions()


def test_a_resume_is_read_back_and_another_deployments_drain_kept(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock],
) -> None:
    executor, slurm, state, _clock = setup
    ours = marks.new_decision_id()
    FakeScheduler.drain(slurm, "node3", _reason(ours))
    theirs = "straggler: persistent x [d-00000000ffff@bbbb]"
    FakeScheduler.drain(slurm, "node2", theirs)
    assert not executor.resume_ours("node2", theirs, marks.new_decision_id())
    assert slurm.node_table["node2"].drained
    slurm.effect["resume"] = "lands"
    resume_id = marks.new_decision_id()
    assert not executor.resume_ours("node3", _reason(ours), resume_id)  # unknown yet
    executor.recover()
    assert state.decision(resume_id)["state"] == "verified"


def _held(clock: FakeClock, job_id: str, mark: str, restarts: int = 1) -> JobInfo:
    return held_job(clock, job_id, mark, restarts, submit_time=clock() - 100)


def test_an_orphan_release_is_read_back_and_retried(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock],
) -> None:
    executor, slurm, state, clock = setup
    job = _held(clock, "41", "straggler: compute node3 +40.0% evict [d-00000000aaaa@aaaa]")
    slurm.job_table["41"] = job
    slurm.effect["release"] = "nothing"
    assert executor.release_orphans([job]) == ["41"]
    (release,) = [d for d in state.open_decisions() if d.get("action") == "release"]
    assert release["state"] == "planned"
    assert executor.release_orphans(list(slurm.job_table.values())) == []  # one at a time
    executor.recover()
    assert state.decision(release["id"])["state"] == "verified"
    assert not slurm.job_table["41"].held


def test_an_eviction_given_up_whose_requeue_landed_late_is_released(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock],
) -> None:
    """Repro: a requeuehold that timed out and landed after the decision was given up left
    the job held by us with a closed decision: nothing released it."""
    executor, slurm, state, clock = setup
    state.save_decision(
        "d-00000000abcd",
        {"state": "abandoned", "action": "evict", "job_id": "42", "restarts_before": "0"},
    )
    job = _held(clock, "42", "straggler: compute node3 +40.0% evict [d-00000000abcd@aaaa]")
    slurm.job_table["42"] = job
    assert executor.release_orphans([job]) == ["42"]
    assert not slurm.job_table["42"].held
    assert state.decision("d-00000000abcd")["landed_late"]
    slurm.job_table["42"] = job  # held again later (by its user): no longer ours to release
    assert executor.release_orphans([job]) == []


def test_a_planned_eviction_whose_job_completes_into_our_hold_is_finished(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock],
) -> None:
    """Repro (CI, the controller restarted right after our requeuehold): past the grace the
    job read COMPLETING with our hold set and its restart counted, was taken for "requeuehold
    never happened" and the decision given up; a second later it read held, and the hold was
    released as one that landed late: the job ran again on node3. A job completing into our
    hold is held: the eviction goes on (node3 excluded, released, verified)."""
    executor, slurm, state, clock = setup
    mark = "straggler: compute node3 +40.0% evict [d-00000000abce@aaaa]"
    state.save_decision(
        "d-00000000abce",
        {
            "state": "planned",
            "action": "evict",
            "job_id": "43",
            "node": "node3",
            "nodes": ["node3"],
            "restarts_before": "0",
            "planned_at": f"{clock() - 2 * GRACE:.3f}",
        },
    )
    completing = replace(_held(clock, "43", mark), state="COMPLETING", reason="JobHeldUser")
    assert completing.hold_landed
    assert not completing.held
    slurm.job_table["43"] = completing
    executor.recover()
    decision = state.decision("d-00000000abce")
    assert decision["state"] == "verified", decision
    assert "landed_late" not in decision
    assert slurm.job_table["43"].excluded == ("node3",)
    assert not slurm.job_table["43"].hold_landed
    assert executor.release_orphans(list(slurm.job_table.values())) == []


def test_a_waiting_decision_closes_when_its_job_ends(make_loop: Callable[..., Loop]) -> None:
    """Repro: a waiting decision never closed when its job ended."""
    clock = FakeClock()
    job = replace(running_job(clock, policy="evict"), submit_time=clock() - 700)
    slurm = FakeScheduler([job], NODES)
    loop = make_loop(slurm, clock, "a")
    loop.state.save_decision(
        "d-00000000cafe", {"state": "waiting", "action": "evict", "job_id": "5", "node": "node3"}
    )
    publish(loop, job, range(10), {})
    loop.service.cycle()
    assert loop.state.decision("d-00000000cafe")["state"] == "waiting"
    del slurm.job_table["5"]  # the job ended
    loop.service.cycle()
    closed = loop.state.decision("d-00000000cafe")
    assert closed["state"] == "abandoned"
    assert "stopped running" in closed["error"]


def test_a_users_hold_after_our_eviction_is_never_released(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock],
) -> None:
    """Found by the model test: after our eviction, Redis forgot it, then the job's user held
    the job; our eviction mark was still on it and the hold was released as our orphan. The
    mark now says "evicted" once we released the job, and such a hold stays."""
    executor, slurm, state, clock = setup
    job = replace(running_job(clock, "43"), submit_time=clock() - 100)
    slurm.job_table["43"] = job
    slurm.annotate("43", marks.reason("compute node3", "+40.0% evict", "d-00000000beef", "aaaa"))
    assert executor.evict("d-00000000beef", slurm.job_table["43"], "node3") == "verified"
    assert " evicted [d-00000000beef@aaaa]" in slurm.job_table["43"].admin_comment
    state.client.flushdb()  # Redis restarted without persistence
    held = replace(slurm.job_table["43"], state="PENDING", reason="JobHeldUser", priority=0)
    slurm.job_table["43"] = held  # the user's `scontrol hold`
    assert executor.release_orphans([held]) == []
    assert slurm.job_table["43"].held


def test_a_release_that_landed_never_lifts_the_hold_its_user_put_after(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock],
) -> None:
    """Our release timed out after it landed; the job's user then held it (`scontrol uhold`).
    The retries see a hold that is not our requeuehold's: they leave it, and the eviction is
    verified (requeued, node excluded) with the hold named."""
    executor, slurm, state, clock = setup
    slurm.job_table["44"] = replace(running_job(clock, "44"), submit_time=clock() - 100)
    slurm.effect["release"] = "lands"
    assert executor.evict("d-00000000cafe", slurm.job_table["44"], "node3") == "pending"
    assert not slurm.job_table["44"].held  # it landed
    slurm.hold("44")
    before = len(slurm.calls)
    for _ in range(3):
        executor.recover()
        clock.advance(10)
    assert ("release", "44") not in slurm.calls[before:]
    assert slurm.job_table["44"].reason == "JobHeldUser"
    decision = state.decision("d-00000000cafe")
    assert decision["state"] == "verified", decision
    assert "not ours to release" in decision["verified"]


def test_a_hold_whose_reason_the_jobs_own_text_blurs_is_never_released(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock],
) -> None:
    """Issue 38, item 1: after our release landed an admin held the job, whose comment says
    `Reason=job_requeued_in_held_state`: Slurm's line names two reasons (the scheduler reads
    HOLD_UNCLEAR). The retries never release it and say why."""
    executor, slurm, state, clock = setup
    slurm.job_table["45"] = replace(running_job(clock, "45"), submit_time=clock() - 100)
    slurm.effect["release"] = "lands"
    assert executor.evict("d-00000000f00d", slurm.job_table["45"], "node3") == "pending"
    slurm.job_table["45"] = replace(
        slurm.job_table["45"], state="PENDING", reason=HOLD_UNCLEAR, priority=0, nodes=()
    )
    before = len(slurm.calls)
    for _ in range(3):
        executor.recover()
        clock.advance(10)
    assert ("release", "45") not in slurm.calls[before:]
    assert slurm.job_table["45"].held
    decision = state.decision("d-00000000f00d")
    assert "cannot be told ours" in str(decision), decision


@pytest.mark.parametrize(
    ("effect", "outcome"),
    [("", "verified"), ("lands", "verified"), ("lost", "failed"), ("nothing", "failed")],
)
def test_a_mark_is_read_back_from_slurm(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock], effect: str, outcome: str
) -> None:
    """Issue 25 item 3: an annotation is what Slurm shows afterwards, a timeout that landed
    included; one that did not land, or did nothing, is "failed", never taken for done."""
    executor, slurm, _state, clock = setup
    slurm.job_table["45"] = running_job(clock, "45")
    slurm.effect["annotate"] = effect
    text = marks.reason("compute node3", "+40.0% annotate", "d-0000000000aa", "aaaa")
    assert executor.annotate(slurm.job_table["45"], text) == outcome
    slurm.fail["job"] = _timeout()
    assert executor.annotate(slurm.job_table["45"], text) == "unknown"  # Slurm did not answer


def test_an_eviction_whose_mark_did_not_land_says_so_in_its_own_record(
    make_loop: Callable[..., Loop],
) -> None:
    """Repro: the mark's read-back was saved before the eviction's first record, so the audit
    began with a row of the decision that had no state, job or action."""
    clock = FakeClock()
    slurm = Flaky([running_job(clock)], NODES)
    slurm.effect["annotate"] = "nothing"
    loop = make_loop(slurm, clock, "a")
    for cycle in range(20):
        publish(loop, slurm.job_table["5"], range(cycle * 10, cycle * 10 + 10), {"node3": 2.0})
        loop.service.cycle()
        clock.advance(1)
        if any(c[0] == "release" for c in slurm.changes):
            break
    (eviction,) = [d for d in loop.state.job_decisions("5") if d.get("action") == "evict"]
    assert eviction["annotated"] == "failed", eviction
    assert eviction["state"] == "verified", eviction
    first = next(row for row in loop.state.audit() if row["id"] == eviction["id"])
    assert (first.get("state"), first.get("job_id")) == ("planned", "5"), first


@pytest.mark.parametrize("effect", ["lands", "lost"])
def test_a_persistent_drain_is_refused_from_the_plan_and_finished_on_recovery(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock], effect: str
) -> None:
    """Issue 38, item 8: a persistent straggler's drain that landed but timed out got no
    prolog refusal (a plain RESUME put the node back in service), and one the service never
    sent (killed between plan and call, or lost) was closed `abandoned` with the node never
    drained. The refusal is written with the plan; a drain that never landed is sent again on
    recovery while the refusal stands, and verified from what Slurm shows."""
    executor, slurm, state, clock = setup
    slurm.effect["drain"] = effect
    decision_id = marks.new_decision_id()
    reason = _reason(decision_id)
    assert executor.drain(decision_id, "node3", reason, persistent=True) == "pending"
    refusal = state.refusal("node3")
    assert refusal is not None
    assert refusal["decision_id"] == decision_id
    clock.advance(GRACE + 1)
    executor.recover()
    decision = state.decision(decision_id)
    assert decision["state"] == "verified", decision
    assert slurm.node_table["node3"].drained
    drains = [c for c in slurm.calls if c[0] == "drain"]
    assert len(drains) == (1 if effect == "lands" else 2), slurm.calls
    assert not state.open_decisions()


def test_a_drain_whose_refusal_was_forgiven_is_not_sent_again(
    setup: tuple[Executor, Flaky, ServiceState, FakeClock],
) -> None:
    """An admin forgave the node while its drain's outcome was unknown: recovery closes the
    decision `abandoned` and never drains the node."""
    executor, slurm, state, clock = setup
    slurm.effect["drain"] = "lost"
    decision_id = marks.new_decision_id()
    assert executor.drain(decision_id, "node3", _reason(decision_id), persistent=True) == "pending"
    state.withdraw_refusal("node3")
    clock.advance(GRACE + 1)
    executor.recover()
    assert state.decision(decision_id)["state"] == "abandoned"
    assert not slurm.node_table["node3"].drained
    assert len([c for c in slurm.calls if c[0] == "drain"]) == 1
