"""The control loop without a cluster: the real Service, executor, state and telemetry store on
a private redis-server, with slurm_plugin.testing's FakeScheduler and FakeClock."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_plugin.cli.main import cli
from slurm_plugin.config import Settings
from slurm_plugin.errors import SlurmError
from slurm_plugin.health.checks import verdict
from slurm_plugin.health.hook import HookResult, _redis_prolog
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.policy.history import Incident, NodeHistory
from slurm_plugin.store.nodes import NodeRecord
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.conftest import RedisServer, copy_policies
from tests.integration.loop_harness import (
    EVICTION,
    NO_REQUEUE,
    NODES,
    Loop,
    flag_while_waiting_for_a_checkpoint,
    held_job,
    make_loop,
    publish,
    run_cycles,
    running_job,
)

__all__ = ["make_loop"]  # the fixture, from loop_harness

GPU_FINDING = "gpu: 7 of 8 GPUs visible"


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
    assert [c[0] for c in slurm.changes] == EVICTION
    job = slurm.job_table["5"]
    assert (job.excluded, job.restarts, "node3" in job.nodes) == (("node3",), 1, False)
    (decision,) = loop.state.job_decisions("5")
    assert decision["state"] == "verified"


def test_a_job_slurm_will_not_let_us_mark_is_never_evicted(
    make_loop: Callable[..., Loop],
) -> None:
    """A service account with AdminLevel=Operator may requeue but not set AdminComment (Slurm
    answers "Access/permission denied"): the job is left running and unmarked, the decision
    failed with what to grant, and the eviction not counted."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    slurm.fail["annotate"] = SlurmError("scontrol: exit 1: Access/permission denied for job 5")
    loop = make_loop(slurm, clock, "a")
    for cycle in range(20):
        publish(loop, slurm.job_table["5"], range(cycle * 10, cycle * 10 + 10), {"node3": 2.0})
        loop.service.cycle()
        clock.advance(1)
        if loop.state.job_decisions("5"):
            break
    assert [c[0] for c in slurm.changes] == ["annotate"]
    job = slurm.job_table["5"]
    assert (job.state, job.restarts, job.admin_comment) == ("RUNNING", 0, "")
    (decision,) = loop.state.job_decisions("5")
    assert decision["state"] == "failed"
    assert "AdminLevel=Admin" in decision["error"]
    assert loop.state.job("5").get("evictions", "0") == "0"


def test_one_waiting_decision_and_max_wait_is_honoured(make_loop: Callable[..., Loop]) -> None:
    """Issue 13 item 5: a job that reports checkpoints gets one waiting decision however often
    the straggler is seen again; its clock is not reset, so after max_wait_s (900 s) without a
    checkpoint the job is evicted (still slow), counted before acting, nothing left open. The
    last checkpoint is 10 minutes old: losing that work costs more than waiting (issue 24)."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    loop.store.publish("5", events=[{"name": "checkpoint_end", "ts": clock() - 600, "step": 0}])
    run_cycles(loop, 0, 60, {"node3": 2.0})
    decisions = loop.state.job_decisions("5")
    assert [d["state"] for d in decisions] == ["waiting"]
    assert slurm.changes == []
    clock.advance(900)
    run_cycles(loop, 600, 2, {"node3": 2.0})
    # Past max_wait_s either the waiting decision acts ("max wait") or, when the node is
    # reported again first (every rearm_s), a new decision evicts and closes the waiting one.
    decisions = loop.state.job_decisions("5")
    (decision,) = [d for d in decisions if d.get("action") == "evict"]
    assert decision["state"] == "verified"
    assert (
        decision.get("after") == "max wait"
        or "no checkpoint within 900 s: evicting" in decision["reasons"]
    ), decision
    assert all(d["state"] == "recorded" for d in decisions if d is not decision), decisions
    # Our mark (with the decision id) goes on the job before it is held.
    assert [c[0] for c in slurm.changes] == EVICTION
    assert decision["id"] in slurm.changes[0][2]
    assert loop.state.job("5")["evictions"] == "1"
    assert loop.state.open_decisions() == []


def test_a_burst_that_is_over_is_not_evicted(make_loop: Callable[..., Loop]) -> None:
    """Issue 13 item 5: node3 is 2x slow for a while and then as fast as its peers before the
    job's next checkpoint; after the checkpoint the service re-checks the newest steps and
    records "recovered, not evicted" instead of requeueing the job."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    flag_while_waiting_for_a_checkpoint(loop)
    run_cycles(loop, 400, 5, {})  # the burst is over
    loop.store.publish("5", events=[{"name": "checkpoint_end", "ts": clock(), "step": 440}])
    run_cycles(loop, 450, 1, {})
    (decision,) = loop.state.job_decisions("5")
    assert decision["state"] == "recorded"
    assert "recovered, not evicted" in decision["reasons"]
    assert [c[0] for c in slurm.changes if c[0] != "annotate"] == []
    assert loop.state.job("5").get("evictions", "0") == "0"


STRICT = """
description = "evict after the checkpoint, only slowdowns of 40 % or more"
[detection]
min_slowdown_pct = 40.0
[actions]
persistent_prior = 0.99  # a fault, as in copy_policies
mode = "evict"
when = "after_checkpoint"
max_wait_s = 900
max_requeues = 2
"""


@pytest.mark.parametrize(("after", "evicted"), [(1.3, True), (1.1, False)])
def test_a_node_slightly_better_at_the_recheck_is_still_evicted(
    make_loop: Callable[..., Loop], tmp_path: Path, after: float, evicted: bool
) -> None:
    """Hysteresis: flagged at the policy's minimum (40 %), released below half of it. node3,
    2x slow when flagged, is 30 % slow at the re-check (under the minimum, over half of it):
    still evicted; 10 % slow: recovered, not evicted."""
    policies = copy_policies(tmp_path / "policies")
    (policies / "strict.toml").write_text(STRICT)
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock, policy="strict")], NODES)
    loop = make_loop(slurm, clock, "a", policy_dir=policies)
    flag_while_waiting_for_a_checkpoint(loop)
    run_cycles(loop, 400, 5, {"node3": after})
    loop.store.publish("5", events=[{"name": "checkpoint_end", "ts": clock(), "step": 440}])
    run_cycles(loop, 450, 1, {"node3": after})
    decision, *later = loop.state.job_decisions("5")  # later: the smaller shift, flagged anew
    assert all(d["state"] == "recorded" and d["decision"] == "none" for d in later), later
    if evicted:
        assert decision["state"] == "verified", decision
        assert slurm.job_table["5"].excluded == ("node3",)
    else:
        assert decision["state"] == "recorded", decision
        assert "recovered, not evicted" in decision["reasons"]
        assert [c[0] for c in slurm.changes if c[0] != "annotate"] == []


@pytest.mark.parametrize(
    ("cluster_policy", "drain_persistent", "dry_run", "drains"),
    [
        ("observe", True, False, False),
        ("no-requeue", True, True, False),
        ("no-requeue", False, False, False),
        ("no-requeue", True, False, True),
    ],
)
def test_only_the_service_takes_a_node_out_after_its_rails(
    make_loop: Callable[..., Loop],
    private_redis: RedisServer,
    tmp_path: Path,
    cluster_policy: str,
    drain_persistent: bool,
    dry_run: bool,
    drains: bool,
) -> None:
    """Issue 13 items 1 and 3, reproduced: three jobs of different users see node3 slow and
    its history turns persistent. Under an observing default policy, in a dry run, or without
    the drain_persistent setting, nothing requeues or drains a node and the next prolog on
    node3 passes (node history alone never keeps a node out); with the setting and an
    evicting default policy the service drains node3 with our mark and a refusal that makes
    the prolog fail. The jobs run under the evicting policy in every case: a job's choice
    never turns draining on."""
    policies = copy_policies(tmp_path / "policies")
    (policies / "no-requeue.toml").write_text(NO_REQUEUE)
    clock = FakeClock()
    jobs = [running_job(clock, str(10 + i), "no-requeue", user=f"user{i}") for i in range(3)]
    slurm = FakeScheduler(jobs, NODES)
    loop = make_loop(
        slurm,
        clock,
        "a",
        dry_run=dry_run,
        policy_dir=policies,
        service={"default_policy": cluster_policy, "drain_persistent": drain_persistent},
        safety={"max_partition_drained_fraction": 1.0},
        # The jobs' slowdowns, reported after ~20 s, are incidents (the shipped rail: 300 s).
        persistence={"sustained_s": 10},
    )
    run_cycles(loop, 0, 40, {"node3": 2.0}, jobs=tuple(j.job_id for j in jobs))
    assert loop.state.node_history("node3").state == "persistent"
    acted = [c[:2] for c in slurm.changes if c[0] != "annotate"]
    assert acted == ([("drain", "node3")] if drains else [])
    if dry_run:
        assert slurm.changes == []
    settings = Settings(redis={"url": private_redis.url})
    result = HookResult(node="node3", job_id="99")
    _redis_prolog(settings, {"SLURM_JOB_ID": "99", "SLURM_NODELIST": "node3"}, result)
    assert verdict(result.findings) == (1 if drains else 0), result.findings
    assert (loop.state.refusal("node3") is not None) == drains


def test_prolog_refuses_only_on_an_explicit_refusal(
    make_loop: Callable[..., Loop], private_redis: RedisServer
) -> None:
    """A refusal the service (after its rails) or an admin wrote fails the prolog; withdrawn,
    the prolog passes and clears its old finding."""
    clock = FakeClock()
    loop = make_loop(FakeScheduler([], NODES), clock, "a")
    settings = Settings(redis={"url": private_redis.url})
    loop.state.refuse("node2", "d-0123456789ab", "straggler: persistent node2 [d-0123456789ab]")
    failed = HookResult(node="node2", job_id="1")
    _redis_prolog(settings, {"SLURM_JOB_ID": "1"}, failed)
    assert verdict(failed.findings) == 1
    assert "d-0123456789ab" in failed.summary()
    assert loop.state.prolog_finding("node2") is not None
    loop.state.withdraw_refusal("node2")
    passed = HookResult(node="node2", job_id="2")
    _redis_prolog(settings, {"SLURM_JOB_ID": "2"}, passed)
    assert verdict(passed.findings) == 0
    assert loop.state.prolog_finding("node2") is None


def test_a_stale_prolog_finding_never_explains_a_later_drain(
    make_loop: Callable[..., Loop],
) -> None:
    """Issue 13 item 1: a finding older than the "Prolog error" drain it would explain is
    dropped, so an unrelated drain never gets our mark (and `node forgive` never resumes it);
    a matching one is explained with our mark."""
    clock = FakeClock()
    drained = [
        replace(n, flags=("DRAIN",), reason="Prolog error", reason_time=clock())
        if n.name in {"node1", "node2"}
        else n
        for n in NODES
    ]
    slurm = FakeScheduler([], drained)
    loop = make_loop(slurm, clock, "a")
    fails = {"exit_code": 1}  # the prolog's own writer, on the service's clock
    NodeRecord(loop.state.client, "node1").record_check(fails, GPU_FINDING, clock())  # this drain's
    NodeRecord(loop.state.client, "node2").record_check(fails, GPU_FINDING, clock() - 3600)
    loop.service.cycle()
    assert [c[:2] for c in slurm.changes] == [("drain", "node1")]
    assert slurm.changes[0][2].startswith("straggler: prolog gpu: 7 of 8 GPUs visible [d-")
    assert loop.state.prolog_finding("node1") is None
    assert loop.state.prolog_finding("node2") is None


def test_a_job_picks_only_allowed_policies(make_loop: Callable[..., Loop]) -> None:
    """Issue 13 item 3: `--comment=straggler:policy=NAME` obeys the same allow-list as the
    SPANK option; a policy outside it gives the cluster default."""
    clock = FakeClock()
    loop = make_loop(
        FakeScheduler([], NODES), clock, "a", service={"allowed_policies": ["observe", "evict"]}
    )
    loop.service.reload_policies()
    assert loop.service.policy_for(running_job(clock, policy="evict")).name == "evict"
    picked = loop.service.policy_for(running_job(clock, policy="evict-aggressive"))
    assert picked.name == "observe"


def test_quiet_nodes_heal_with_time(make_loop: Callable[..., Loop]) -> None:
    """Issue 13 item 6: a node with no incident for forgive_after_days (30) is healthy again
    without any new incident (the audit says so); the refusal of a node we drained stays
    until an admin forgives it."""
    clock = FakeClock()
    loop = make_loop(FakeScheduler([], NODES), clock, "a")
    old = clock() - 31 * 86400
    incidents = tuple(Incident(str(j), old, 40.0) for j in range(3))
    for name in ("node3", "node4"):
        loop.state.save_node_history(
            NodeHistory(name, incidents, "persistent", persistent_since=old, last_incident=old)
        )
    recent = clock() - 86400
    loop.state.save_node_history(
        NodeHistory("node2", (Incident("9", recent, 40.0),), "suspect", last_incident=recent)
    )
    loop.state.refuse("node4", "d-0123456789ab", "straggler: persistent node4 [d-0123456789ab]")
    loop.service.cycle()
    assert loop.state.node_history("node3").state == "ok"
    assert loop.state.node_history("node4").state == "ok"
    assert loop.state.node_history("node2").state == "suspect"
    assert loop.state.refusal("node4") is not None
    forgiven = [e for e in loop.state.audit() if e.get("action") == "forgive"]
    assert sorted(e["node"] for e in forgiven) == ["node3", "node4"]
    assert {e["by"] for e in forgiven} == {"time"}


def test_a_straggler_found_during_a_pause_is_acted_on_after_it(
    make_loop: Callable[..., Loop],
) -> None:
    """Issue 13 item 8: while paused the straggler is held back (one waiting decision, no
    Slurm change); after `resume` it is evicted in the next cycle, still slow."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    loop.state.pause(3600)
    for cycle in range(40):
        run_cycles(loop, cycle * 10, 1, {"node3": 2.0})
        if loop.state.job_decisions("5"):
            break
    run_cycles(loop, 400, 5, {"node3": 2.0})
    (held,) = loop.state.job_decisions("5")
    assert (held["state"], held["waiting_for"]) == ("waiting", "resume")
    assert "service paused by an admin" in held["reasons"]
    assert [c[0] for c in slurm.changes] == ["annotate"]
    loop.state.resume()
    run_cycles(loop, 450, 1, {"node3": 2.0})
    (done,) = loop.state.job_decisions("5")
    assert (done["state"], done["after"]) == ("verified", "resume")
    changes = [c[0] for c in slurm.changes][1:]
    assert changes == ["annotate", "requeue_hold", "set_excluded", "release", "annotate"]


@pytest.mark.parametrize(("cluster_policy", "job_policy", "dry_run"), [
    ("observe", "observe", False),
    ("evict-aggressive", "evict-aggressive", True),
])  # fmt: skip
def test_fifty_jobs_under_observe_or_dry_run_take_nothing_out(
    make_loop: Callable[..., Loop],
    tmp_path: Path,
    cluster_policy: str,
    job_policy: str,
    dry_run: bool,
) -> None:
    """Issue 13's scripted run: 50 jobs on 12 nodes, three of them slow, forged timings (ranks
    claiming a node outside their job), a pause window and then a breaker-open window. Under
    observe, and in a dry run of a policy that evicts and drains, nothing reaches Slurm, not
    even an AdminComment note (the fake scheduler counts every call)."""
    clock = FakeClock()
    names = [f"node{i}" for i in range(1, 13)]
    nodes = [NodeInfo(n, "idle", (), "", ("debug",)) for n in names]
    jobs = [
        running_job(
            clock,
            str(100 + j),
            job_policy,
            user=f"user{j % 7}",
            nodes=tuple(names[(j + k) % 12] for k in range(3)),
        )
        for j in range(50)
    ]
    slurm = FakeScheduler(jobs, nodes)
    loop = make_loop(
        slurm,
        clock,
        "a",
        dry_run=dry_run,
        service={"default_policy": cluster_policy, "drain_persistent": True},
        safety={"max_partition_drained_fraction": 1.0},
    )
    slow = {"node3": 2.0, "node7": 1.5, "node11": 3.0}
    for cycle in range(40):
        if cycle == 10:
            loop.state.pause(600)
        if cycle == 20:
            loop.state.resume()
            loop.state.open_breaker("test: breaker window")
        if cycle == 30:
            loop.state.resume()
        for job in jobs:
            steps = range(cycle * 10, cycle * 10 + 10)
            publish(loop, job, steps, slow)
            outsider = next(n for n in names if n not in job.nodes and n not in slow)
            forged = replace(job, nodes=(*job.nodes[:2], outsider))
            publish(loop, forged, steps, {outsider: 4.0})
        report = loop.service.cycle()
        assert report.error is None, report.error
        clock.advance(1)
    decisions = [d for job in jobs for d in loop.state.job_decisions(job.job_id)]
    assert decisions, "the slow nodes were detected"
    assert {d.get("node") for d in decisions} <= {"node3", "node7", "node11"}
    changes = {c[0] for c in slurm.changes}
    assert changes == set(), changes
    assert loop.state.refusal("node11") is None


def test_the_slowest_node_flagged_while_waiting_is_the_one_evicted(
    make_loop: Callable[..., Loop],
) -> None:
    """Two nodes flagged while a job waits for its checkpoint (node1 a passing blip, node3
    slow): after the checkpoint the re-check evicts node3, not the first one flagged."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    loop.state.save_decision(
        "d-00000000000a",
        {
            "job_id": "5",
            "node": "node1",
            "ranks": [0, 1],
            "state": "waiting",
            "action": "evict",
            "slowdown_pct": 40.0,
            "candidates": [{"node": "node3", "ranks": [4, 5]}],
        },
    )
    loop.state.update_job(
        "5", waiting="d-00000000000a", waiting_since=f"{clock():.3f}", reports_checkpoints="1"
    )
    run_cycles(loop, 0, 4, {"node3": 2.0})
    assert slurm.changes == []
    loop.store.publish("5", events=[{"name": "checkpoint_end", "ts": clock(), "step": 39}])
    run_cycles(loop, 40, 1, {"node3": 2.0})
    decision = loop.state.decision("d-00000000000a")
    assert (decision["state"], decision["node"], decision["after"]) == (
        "verified",
        "node3",
        "checkpoint",
    )
    assert slurm.job_table["5"].excluded == ("node3",)
    assert len(loop.state.job_decisions("5")) == 1


def test_a_job_held_with_our_mark_and_no_record_is_released(
    make_loop: Callable[..., Loop],
) -> None:
    """Issue 18 item 1: Redis lost the decision of an eviction half done (a restart without
    persistence); Slurm still holds the job with our eviction mark. The next cycle releases
    it and audits why. A hold whose decision Redis knows, a hold without our mark and a hold
    with our note of a decision that was no eviction are left alone."""
    clock = FakeClock()

    def held(job_id: str, comment: str) -> JobInfo:
        return held_job(clock, job_id, comment)

    jobs = [
        held("21", "straggler: compute node3 +40.0% evict [d-00000000aaaa]"),
        held("22", "straggler: compute node3 +40.0% evict [d-00000000bbbb]"),
        held("23", "maintenance hold by bob"),
        held("24", "bob's note | straggler: compute node3 +40.0% annotate [d-00000000cccc]"),
    ]
    slurm = FakeScheduler(jobs, NODES)
    loop = make_loop(slurm, clock, "a")
    loop.state.save_decision("d-00000000bbbb", {"state": "verified", "action": "evict"})
    report = loop.service.cycle()
    assert report.error is None, report.error
    assert [c[:2] for c in slurm.changes] == [("release", "21")]
    assert slurm.job_table["21"].state == "RUNNING"
    assert all(slurm.job_table[j].held for j in ("22", "23", "24"))
    planned, verified = [e for e in loop.state.audit() if e.get("action") == "release"]
    assert (planned["job_id"], planned["of"], planned["by"]) == (
        "21",
        "d-00000000aaaa",
        "reconcile",
    )
    assert (verified["id"], verified["state"]) == (planned["id"], "verified")  # read back
    dry = make_loop(
        FakeScheduler([held("25", jobs[0].admin_comment)], NODES), clock, "b", dry_run=True
    )
    assert loop.state.step_down("a")
    assert dry.service.cycle().leader
    assert dry.slurm.changes == []  # a dry run never changes Slurm, not even to release


@pytest.mark.parametrize("labelled", [False, True], ids=["inferred", "labelled"])
def test_a_pipeline_stage_is_never_evicted_but_a_straggler_in_it_is(
    make_loop: Callable[..., Loop], private_redis: RedisServer, labelled: bool
) -> None:
    """Issue 14, through Redis and the service: node3 and node4 run a stage that computes 40 %
    longer by design from the first step. Under `evict`, 20 cycles decide nothing; when node3
    then slows down within its stage (2.0x against the stage's 1.4x), it alone is evicted."""
    clock = FakeClock()
    nodes = ("node1", "node2", "node3", "node4")
    slurm = FakeScheduler([running_job(clock, nodes=nodes)], NODES)
    loop = make_loop(slurm, clock, "a")
    labels = {"node1": "stage0", "node2": "stage0", "node3": "stage1", "node4": "stage1"}
    groups = labels if labelled else None
    stage = {"node3": 1.4, "node4": 1.4}
    for cycle in range(20):
        steps = range(cycle * 10, cycle * 10 + 10)
        publish(loop, slurm.job_table["5"], steps, stage, groups)
        assert loop.service.cycle().error is None
        clock.advance(1)
    assert slurm.changes == []
    assert [d for d in loop.state.job_decisions("5") if d.get("node") != "none"] == []
    # The service noted the structure once, for `straggler job show`.
    shown = CliRunner().invoke(
        cli, ["job", "show", "5", "--json"], env={"STRAGGLER_REDIS_URL": private_redis.url}
    )
    assert shown.exit_code == 0, shown.output
    learned = json.loads(shown.stdout)["structure"]
    assert {tuple(g["nodes"]) for g in learned} >= {("node3", "node4")}, learned
    for cycle in range(20, 60):
        steps = range(cycle * 10, cycle * 10 + 10)
        publish(loop, slurm.job_table["5"], steps, {**stage, "node3": 2.0}, groups)
        loop.service.cycle()
        clock.advance(1)
        if slurm.job_table["5"].restarts:
            break
    assert slurm.job_table["5"].excluded == ("node3",)
    evicted = [d for d in loop.state.job_decisions("5") if d.get("action") == "evict"]
    assert [d["node"] for d in evicted] == ["node3"]
