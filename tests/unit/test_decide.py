"""The decision engine: every rail, the goodput rule and the shipped policies."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from slurm_plugin.detection.events import StragglerEvent
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.policy.decide import (
    ClusterContext,
    Decision,
    JobContext,
    decide,
    is_node_slow,
    is_slowdown,
    outlook,
)
from slurm_plugin.policy.rails import SafetyPolicy
from tests.scenarios.decisions import NODES, NOW, POLICIES
from tests.scenarios.decisions import event as _event
from tests.scenarios.decisions import job as _job


def _decide(
    policy: str = "evict",
    job: JobInfo | None = None,
    ctx: JobContext | None = None,
    cluster: ClusterContext | None = None,
    event: StragglerEvent | None = None,
) -> Decision:
    return decide(
        event or _event(),
        job or _job(),
        POLICIES[policy],
        ctx or JobContext(last_checkpoint_ts=NOW - 60),
        cluster or ClusterContext(nodes=NODES),
        NOW,
    )


def test_evict_when_it_pays_off() -> None:
    """+10 % for ~3 h left saves far more than a restart costs: evict."""
    d = _decide(ctx=JobContext(last_checkpoint_ts=NOW - 60))
    assert d.action == "evict"
    assert d.saved_s is not None
    assert d.cost_s is not None
    assert d.saved_s > d.cost_s


def test_goodput_rule_refuses_when_little_time_is_left() -> None:
    """With 5 minutes left, a requeue costs more than it saves: annotate only."""
    d = _decide(job=_job(start_time=NOW - 4 * 3600 + 300))
    assert d.action == "annotate"
    assert any(r.startswith("goodput: evicting saves") for r in d.reasons)


def test_a_burst_that_just_began_is_expected_to_pass() -> None:
    """Issue 14 and 24: 3x slower for 5 s, on a node no other job saw slow, with 4 h of the
    job left: a passing slowdown is still on after 5 s with probability 30 / (30 + 5) (heavy
    tailed, scale transient_s), so the chance that it lasts is 0.05 / (0.05 + 0.95 x 0.857)
    = 5.8 %, under the policy's min_lasting_p: not evicted; the record says how long it
    lasted and how long it is expected to."""
    d = _decide(event=_event(slowdown=200.0, lasted_s=5.0))
    assert d.action == "annotate"
    assert d.lasted_s == pytest.approx(5.0)
    assert d.lasting_p == pytest.approx(0.0579, abs=0.0005)
    assert d.expected_s is not None
    assert d.expected_s < 0.1 * 3 * 3600
    (why,) = [r for r in d.reasons if r.startswith("not sure it lasts")]
    assert why.startswith("not sure it lasts: 6% likely, the policy acts from 60%")
    assert "lasted 5 s, expected" in why


def test_the_longer_it_lasts_the_more_it_is_expected_to() -> None:
    """The same slowdown (+30 %: a quarter of the job's time) once it has lasted 5 minutes
    is likelier a fault (37 %) but may still pass; after 15 minutes (62 %) it is expected to
    last most of what is left of the job, and evicted."""
    young = _decide(event=_event(slowdown=30.0, lasted_s=5.0))
    middle = _decide(event=_event(slowdown=30.0, lasted_s=300.0))
    old = _decide(event=_event(slowdown=30.0, lasted_s=900.0))
    assert middle.action == "annotate"
    assert any(r.startswith("not sure it lasts: 37% likely") for r in middle.reasons)
    assert middle.lasting_p == pytest.approx(0.367, abs=0.005)
    assert old.action == "evict"
    assert young.expected_s is not None
    assert old.expected_s is not None
    assert old.lasting_p is not None
    assert old.expected_s > 9 * young.expected_s  # a passing one, too, goes on longer
    assert old.lasting_p == pytest.approx(0.62, abs=0.005)


def test_a_node_that_makes_the_job_much_slower_is_evicted_before_it_is_sure() -> None:
    """3x slower (two thirds of the job's time) for 5 minutes: 37 % that it lasts, under
    min_lasting_p, but waiting the 525 s until it is 60 % likely would cost the job, on
    average, 0.667 x 392 s = 261 s of its time, more than the 240 s requeue (restart and the
    minute since the checkpoint) that evicting risks: evicted. A policy that accepts the cost
    of doubt (doubt_requeues = 2) waits; a young one (5 s) is never evicted this way."""
    event = _event(slowdown=200.0, lasted_s=300.0)
    d = _decide(event=event)
    assert d.action == "evict"
    assert d.lasting_p == pytest.approx(0.367, abs=0.005)
    assert d.cost_s == pytest.approx(240.0)
    evict = POLICIES["evict"]
    patient = evict.model_copy(
        update={"actions": evict.actions.model_copy(update={"doubt_requeues": 2.0})}
    )
    ctx = JobContext(last_checkpoint_ts=NOW - 60)
    waits = decide(event, _job(), patient, ctx, ClusterContext(nodes=NODES), NOW)
    assert waits.action == "annotate"
    assert any(r.startswith("not sure it lasts") for r in waits.reasons)
    assert _decide(event=_event(slowdown=200.0, lasted_s=5.0)).action == "annotate"


def test_a_node_other_jobs_saw_slow_is_believed_sooner() -> None:
    """A minute into the slowdown: on a fresh node it may still pass (14 % that it lasts, not
    evicted); on a node two other jobs saw slow within the persistence window a lasting fault
    is the likelier story (prior 1 - 0.95 / 3, 87 %), and the job is evicted."""
    event = _event(slowdown=200.0, lasted_s=60.0)
    fresh = _decide(event=event)
    known = _decide(event=event, ctx=JobContext(last_checkpoint_ts=NOW - 60, node_incidents=2))
    assert fresh.action == "annotate"
    assert known.action == "evict"
    assert fresh.lasting_p == pytest.approx(0.136, abs=0.005)
    assert known.lasting_p == pytest.approx(0.866, abs=0.005)


def test_a_slowdown_of_unknown_age_is_taken_as_new() -> None:
    """No start known (an event from an older service): 0 s lasted, the conservative side."""
    event = replace(_event(slowdown=200.0), since_ts=None)
    d = _decide(event=event)
    assert d.lasted_s == 0.0
    assert d.action == "annotate"


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"policy": "observe"}, "policy observes only"),
        ({"job": _job(requeue=False)}, "not requeueable"),
        (
            {"job": _job(nodes=("node1", "node2", "node3", "node4"), node_count=4)},
            "would leave 3 usable nodes",
        ),
        ({"ctx": JobContext(evictions=2)}, "already evicted 2 times"),
        ({"ctx": JobContext(last_eviction_ts=NOW - 60, evictions=1)}, "cooldown"),
        ({"cluster": ClusterContext(nodes=NODES, evictions_last_hour=10)}, "budget spent"),
        ({"cluster": ClusterContext(nodes=NODES, paused=True)}, "paused"),
        ({"cluster": ClusterContext(nodes=NODES, breaker_open=True)}, "circuit breaker"),
    ],
)
def test_rails_block_eviction(kwargs: dict[str, object], reason: str) -> None:
    """Each rail turns an eviction into an annotation that says why; under observe into a
    decision recorded only (observe writes nothing to Slurm, not even a note)."""
    d = _decide(**kwargs)  # type: ignore[arg-type]
    assert d.action == ("none" if kwargs.get("policy") == "observe" else "annotate")
    assert any(reason in r for r in d.reasons), d.reasons


@pytest.mark.parametrize(
    ("slowdown", "cause", "minimum"),
    [(2.0, "compute", "3"), (-5.0, "compute", "3"), (-14.0, "compute", "3"), (5.0, "input", "10")],
)
def test_speed_ups_and_small_slowdowns_are_no_incident(
    slowdown: float, cause: str, minimum: str
) -> None:
    """Issue 13 item 7: a rank faster than its peers (a negative "slowdown") or slower by less
    than the policy's minimum is neither evicted nor annotated ("+-5.0%") nor an incident."""
    event = _event(slowdown=slowdown, cause=cause)
    d = _decide(event=event)
    assert d.action == "none"
    assert d.reasons == [
        f"estimated slowdown {slowdown:.1f}% is below the policy's minimum of {minimum}%"
    ]
    assert not is_slowdown(event, POLICIES["evict"])
    assert is_slowdown(_event(slowdown=3.0), POLICIES["evict"])


def test_input_cause_is_never_evicted_and_off_does_nothing() -> None:
    """Slow data is reported; policy off ignores everything."""
    assert _decide(event=_event(cause="input")).action == "annotate"
    assert _decide(policy="off").action == "none"


def test_after_checkpoint_waits_then_evicts() -> None:
    """A job that reports checkpoints is evicted after the next one, or after max wait."""
    ctx = JobContext(last_checkpoint_ts=NOW - 60, reports_checkpoints=True, waiting_since=NOW)
    assert _decide(ctx=ctx).action == "wait"
    late = JobContext(
        last_checkpoint_ts=NOW - 60, reports_checkpoints=True, waiting_since=NOW - 1000
    )
    assert _decide(ctx=late).action == "evict"
    assert _decide(cluster=ClusterContext(nodes=NODES, dry_run=True)).action == "annotate"


def test_cluster_rails_bound_every_job_whatever_its_policy() -> None:
    """Issue 13 item 3: the eviction budget and spare nodes come from the cluster's rails (the
    service's settings), whatever policy the job runs under."""
    loose = POLICIES["evict-aggressive"]
    spent = ClusterContext(
        nodes=NODES, evictions_last_hour=1, safety=SafetyPolicy(max_evictions_per_hour=1)
    )
    d = decide(_event(), _job(), loose, JobContext(last_checkpoint_ts=NOW - 60), spent, NOW)
    assert d.action == "annotate"
    assert any("eviction budget spent" in r for r in d.reasons)
    open_budget = ClusterContext(nodes=NODES, evictions_last_hour=1)  # the default: 10 an hour
    assert decide(_event(), _job(), loose, JobContext(), open_budget, NOW).action == "evict"


@pytest.mark.parametrize("incidents", [0, 1, 3])
def test_the_age_at_which_a_slowdown_is_believed_is_where_the_outlook_says_so(
    incidents: int,
) -> None:
    """`sure_in_s` (how much longer until min_lasting_p) agrees with the outlook itself: at
    that age the slowdown is exactly min_lasting_p likely to last (825 s on a fresh node at
    the shipped prior and transient_s; at once on a node another job saw slow)."""
    policy = POLICIES["evict"]
    ctx = JobContext(node_incidents=incidents)
    young = outlook(_event(lasted_s=0.0), _job(), ctx, policy, NOW)
    aged = outlook(_event(lasted_s=young.sure_in_s), _job(), ctx, policy, NOW)
    if young.sure_in_s > 0:
        assert aged.lasting_p == pytest.approx(policy.actions.min_lasting_p, abs=1e-6)
    else:
        assert young.lasting_p >= policy.actions.min_lasting_p
    assert aged.sure_in_s == pytest.approx(0.0, abs=1e-6)
    if incidents == 0:
        assert young.sure_in_s == pytest.approx(825.0)


def test_the_final_verdict_is_decided_once_with_the_facts() -> None:
    """Issue 25: the service logged `evict` before overrides that cancelled it, and the
    "already evicting" branch saved decision=evict with action=none. One pure step now."""
    from slurm_plugin.policy.decide import Decision  # noqa: PLC0415
    from slurm_plugin.policy.verdict import UNKNOWN, Facts, final  # noqa: PLC0415

    evict = Decision("evict", "node3", ["goodput: saves 900 s, costs 200 s"])
    assert final(evict, Facts()) == (evict, {})
    busy, record = final(evict, Facts(evicting=True))
    assert (busy.action, record["decision"]) == ("none", "none")
    assert record["reasons"] == ["an eviction is in progress"]
    recovered, record = final(evict, Facts(recheck="recovered, not evicted: node3 is +0.2%"))
    assert (recovered.action, record["decision"]) == ("none", "none")
    unsure, record = final(evict, Facts(recheck=UNKNOWN))
    assert (unsure.action, record["waiting_for"]) == ("wait", "recheck")  # never "recovered"
    annotate = Decision("annotate", "node3", ["below the minimum"])
    assert final(annotate, Facts(evicting=True, recheck=UNKNOWN)) == (annotate, {})


def test_unknown_is_not_the_worst_case() -> None:
    """Class 2 of the full-scale month: a 16-GPU job without a time limit, 10 hours in, that
    reports no checkpoints (at a site that says its jobs checkpoint hourly), with a GPU at
    +55 % (35 % of the job's time) for half an hour.
    Taken to lose all 10 hours and to end within the hour, it was never evicted; it ran on
    for 21 hours. Now its remaining run is what a job 10 hours old is expected to run on
    (heavy-tailed run lengths up to 7 days: 10 h x ln(16.8), ~28 h), a requeue loses half the
    site's checkpoint interval, and the decision says both assumptions."""
    job = _job(time_limit_s=None, start_time=NOW - 10 * 3600)
    event = replace(_event(55.0, lasted_s=1800.0), job_loss_pct=35.0)
    no_checkpoints = JobContext()
    evict = POLICIES["evict"]
    site = evict.model_copy(
        update={"actions": evict.actions.model_copy(update={"assume_checkpoint_s": 3600.0})}
    )
    cluster = ClusterContext(nodes=NODES)
    d = decide(event, job, site, no_checkpoints, cluster, NOW)
    assert d.action == "evict", d.reasons
    assert d.inputs is not None
    assert d.inputs["remaining_s"] == pytest.approx(36000 * math.log(7 * 24 / 10), abs=1)
    assert d.inputs["remaining_from"] == "expected of a job 36000 s old (no time limit)"
    assert d.inputs["lost_work_s"] == pytest.approx(1800)
    assert d.inputs["lost_work_from"] == "half the site's 3600 s checkpoint interval"
    # Without the site's interval (the shipped policies: a month's hold-outs lost by
    # assuming one), the work since the start is still what a requeue loses.
    d = decide(event, job, evict, no_checkpoints, cluster, NOW)
    assert d.inputs is not None
    assert d.inputs["lost_work_s"] == pytest.approx(10 * 3600)
    assert d.inputs["lost_work_from"] == "the job's start (no checkpoint known)"
    assert d.action == "annotate"
    # A job just started is never credited with more work than it did.
    young = _job(time_limit_s=None, start_time=NOW - 600)
    d = decide(event, young, site, no_checkpoints, cluster, NOW)
    assert d.inputs is not None
    assert d.inputs["lost_work_s"] == pytest.approx(600)
    assert d.inputs["remaining_s"] == pytest.approx(600 * math.log(7 * 86400 / 600), abs=1)


def test_a_marginal_saving_on_a_big_stake_is_not_evicted() -> None:
    """Class 1 of the full-scale month: a 2,048-GPU job whose node costs it 65 % of its time
    in an episode 18 minutes old (66 % likely to last, on a node no other job saw slow), 2 h
    left, an hour of work since its last checkpoint: evicting saves ~3,625 s and costs
    3,600 s on average, but whether it saves anything depends on the episode lasting (such
    episodes mostly end within the hour). Decided on the expected saving alone it was
    evicted, and the episode ended a minute later; within half a standard deviation of the
    saving it is not. A clear saving still is."""
    # One node of it here: saving and cost are job seconds, the same for any number of GPUs.
    job = _job(nodes=("node3",), node_count=1, start_time=NOW - 3 * 3600, time_limit_s=5 * 3600.0)
    event = replace(_event(280.0, lasted_s=1100.0), job_loss_pct=65.4)
    ctx = JobContext(last_checkpoint_ts=NOW - 3420)
    cluster = ClusterContext(nodes=NODES, safety=SafetyPolicy(min_spare_nodes=0))
    evict = POLICIES["evict"]
    means_only = evict.model_copy(
        update={"actions": evict.actions.model_copy(update={"risk_sd": 0.0})}
    )
    before = decide(event, job, means_only, ctx, cluster, NOW)
    assert before.action == "evict"
    assert before.saved_s == pytest.approx(3625, abs=40)
    assert before.cost_s == pytest.approx(3600)
    assert before.lasting_p == pytest.approx(0.66, abs=0.01)
    now = decide(event, job, evict, ctx, cluster, NOW)
    assert now.action == "annotate"
    (why,) = [r for r in now.reasons if r.startswith("goodput too uncertain")]
    assert "costs 3600 s, a margin within 0.5 standard deviation" in why
    clear = decide(event, job, evict, JobContext(last_checkpoint_ts=NOW - 60), cluster, NOW)
    assert clear.action == "evict", clear.reasons


def test_a_straggler_that_blends_into_its_jobs_drift_is_not_acted_on() -> None:
    """Issue 36, the held-out noise model: a long, costly slowdown of a rank whose smoothed
    level stands 3.1 spreads above its job's other ranks', where a straggler among them must
    clear 4.1, is the slowest of healthy ranks that drift: no action, no note, no slowdown
    for node history. Clearing the bar, or unknown (too few ranks, an older record), it is
    decided as before."""
    event = replace(_event(12.0, lasted_s=3600.0), job_loss_pct=8.0)
    cluster = ClusterContext(nodes=NODES)
    evict = POLICIES["evict"]
    blended = replace(event, level_z=3.1, level_z_min=4.1)
    d = decide(blended, _job(), evict, JobContext(), cluster, NOW)
    assert d.action == "none"
    assert d.reasons == [
        (
            "node3 does not stand out from the job's own rank-to-rank variation: its level is "
            "3.1 spreads above the other ranks', a straggler among this many ranks must clear 4.1"
        )
    ]
    assert not is_slowdown(blended, evict)
    assert not is_slowdown(replace(event, level_z=math.nan, level_z_min=4.1), evict)
    for clear in (replace(event, level_z=4.2, level_z_min=4.1), event):
        assert is_slowdown(clear, evict)
        assert decide(clear, _job(), evict, JobContext(), cluster, NOW).action == "evict"
    # Data loading is compared by its own chart, never by the compute level.
    assert not replace(blended, cause="input").blends_in


def test_a_slow_gpu_the_job_does_not_wait_for_is_a_slow_node_not_a_slowdown() -> None:
    """Issue 36, classes 5 and 8: one GPU +9 % in the faster of two pipeline stages costs
    the job 0 % of its time: no action and no note (the job would be no faster without it),
    yet its node is slow, and node history counts it (a second job on that node saw it
    slow too). One that blends in, or under the minimum, is neither."""
    event = replace(_event(9.0, lasted_s=3600.0), job_loss_pct=0.0, level_z=20.0, level_z_min=5.0)
    evict = POLICIES["evict"]
    d = decide(event, _job(), evict, JobContext(), ClusterContext(nodes=NODES), NOW)
    assert d.action == "none"
    assert d.reasons[0].startswith("the job would be no faster without node3")
    assert is_node_slow(event, evict)
    assert not is_slowdown(event, evict)
    for neither in (replace(event, level_z=3.0), replace(event, slowdown_pct=2.0)):
        assert not is_node_slow(neither, evict)
        assert not is_slowdown(neither, evict)


def test_gpus_that_may_be_a_stage_wait_for_another_jobs_word() -> None:
    """Issue 36, class 6: GPUs 6-7 of a two-node job's node, +20 % since the job's first
    steps without labels, may be a pipeline stage laid over them (the detector says so:
    ``maybe_a_stage``; a fault slows one GPU or the whole node). Not evicted while no other
    job saw the node slow, only noted, and never counted in node history itself (a two-node
    pipeline run again on the same nodes would mark a healthy one). Seen slow by another
    job, it is evicted; one GPU or the whole node from the start is evicted as any straggler,
    and counted."""
    spare = tuple(NodeInfo(f"node{i}", "idle", (), "", ("debug",)) for i in range(5, 9))
    evict, cluster = POLICIES["evict"], ClusterContext(nodes=NODES + spare)
    two = _job(nodes=("node2", "node3"), node_count=2)
    event = replace(_event(20.0, lasted_s=3600.0), from_start=True, maybe_a_stage=True)
    assert is_slowdown(event, evict)
    assert not is_node_slow(event, evict)  # never its own word in node history
    d = decide(event, two, evict, JobContext(), cluster, NOW)
    assert d.action == "annotate"
    says = "node3's GPUs slow since the job's first steps may be a pipeline stage"
    assert any(says in r and "no other job saw node3 slow" in r for r in d.reasons), d.reasons
    seen = decide(event, two, evict, JobContext(node_incidents=1), cluster, NOW)
    assert seen.action == "evict"
    fault = replace(event, maybe_a_stage=False)
    assert is_node_slow(fault, evict)
    assert decide(fault, two, evict, JobContext(), cluster, NOW).action == "evict"


def test_a_slowdown_from_the_start_that_came_back_after_a_requeue_is_the_jobs_design() -> None:
    """Issue 36, class 6: the job was requeued from attempt 0 for a node slow since its
    first steps (nothing told that from a pipeline stage filling the node); attempt 1 is
    slow since its first steps again, on another node: the job's design, not evicted. The
    same attempt, or a slowdown that began later in the job, is decided as ever."""
    spare = tuple(NodeInfo(f"node{i}", "idle", (), "", ("debug",)) for i in range(5, 9))
    evict, cluster = POLICIES["evict"], ClusterContext(nodes=NODES + spare)
    event = replace(_event(40.0, lasted_s=3600.0), from_start=True, attempt=1)
    ctx = JobContext(evictions=1, last_eviction_ts=NOW - 7200, from_start_requeued=0)
    d = decide(event, _job(), evict, ctx, cluster, NOW)
    assert d.action == "annotate"
    assert any("requeued from attempt 0" in r and "design" in r for r in d.reasons), d.reasons
    for decided in (replace(event, attempt=0), replace(event, from_start=False)):
        assert decide(decided, _job(), evict, ctx, cluster, NOW).action == "evict"
    assert decide(event, _job(), evict, JobContext(), cluster, NOW).action == "evict"
