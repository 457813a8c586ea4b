"""The decision lifecycle's own rules (policy/lifecycle.py), pure: what the service and the
backtest both carry out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from slurm_plugin.model.cluster import NodeInfo
from slurm_plugin.policy import lifecycle
from slurm_plugin.policy.decide import ClusterContext, JobContext
from slurm_plugin.policy.lifecycle import RECHECK_GAVE_UP, Close, Rechecking, Record, World
from tests.scenarios.decisions import NOW, POLICIES
from tests.scenarios.decisions import slowdown as _event
from tests.scenarios.decisions import world as _world


def test_a_decision_never_waits_forever_for_a_recheck() -> None:
    """Class 3 of the full-scale month: a decision waited for hours on "no recent steps of
    the node to re-check". It is decided again every cycle for at most ``max_wait_s``, then
    closed with why (the node's next detection decides anew, on its own steps)."""
    state, effects, decision = lifecycle.detected(None, _event(), 0, "d1", _world(NOW))
    assert state is not None
    assert (state.waiting_for, state.rechecking_since) == ("recheck", NOW)
    (record,) = effects
    assert isinstance(record, Record)
    assert record.extra["rechecking_since"] == NOW
    assert decision.action == "wait"
    limit = POLICIES["evict"].actions.max_wait_s
    now = NOW
    while state is not None and now < NOW + 10 * limit:
        now += 10.0
        state, effects = lifecycle.tick(state, _world(now))
    assert state is None
    (closed,) = effects
    assert isinstance(closed, Close)
    assert closed.reasons[0].startswith(RECHECK_GAVE_UP)
    assert now == NOW + limit


def test_a_waited_decision_starts_its_recheck_clock_when_it_starts_rechecking() -> None:
    """A decision that waited for a checkpoint and then finds nothing to re-check on gets
    its own ``max_wait_s`` from then (one of 0.1's records, without the clock, too)."""
    waiting = lifecycle.Waiting("d1", (lifecycle.Candidate(_event()),), NOW - 3600.0)
    with_checkpoint = replace(_world(NOW), ctx=JobContext(last_checkpoint_ts=NOW))
    state, effects = lifecycle.tick(waiting, with_checkpoint)
    assert state is not None
    assert (state.waiting_for, state.rechecking_since) == ("recheck", NOW)
    assert effects == [Rechecking("d1", NOW)]
    old = replace(state, rechecking_since=None)
    state, effects = lifecycle.tick(old, _world(NOW + 3600.0))
    assert state is not None
    assert effects == [Rechecking("d1", NOW + 3600.0)]


def test_several_bad_nodes_go_in_one_requeue() -> None:
    """Class 4 of the full-scale month: two slow nodes in one job, flagged while its decision
    waits for the checkpoint. Each is charged what it costs with the other dealt with (the
    detector's what-if), so each pays alone: both are excluded in one requeue, one restart,
    the slower first; never more than the rails' nodes per eviction, and never one the
    re-check finds recovered."""
    second = replace(_event(), node="node2", ranks=[3], slowdown_pct=25.0, job_loss_pct=15.0)
    waiting = lifecycle.Waiting(
        "d1",
        (lifecycle.Candidate(_event()), lifecycle.Candidate(second)),
        NOW - 300.0,
    )
    slowdowns = {"node3": 40.0, "node2": 25.0}

    def world(recheck: Mapping[str, float | None], most: int = 4) -> World:
        base = _world(NOW)
        cluster = ClusterContext(
            nodes=tuple(NodeInfo(f"node{i}", "idle", (), "", ("debug",)) for i in range(1, 7)),
            safety=base.cluster.safety.model_copy(update={"max_nodes_per_eviction": most}),
        )
        ctx = JobContext(last_checkpoint_ts=NOW)  # the checkpoint came
        return replace(
            base, cluster=cluster, ctx=ctx, recheck=lambda e, _since: recheck.get(e.node)
        )

    state, effects = lifecycle.tick(waiting, world(slowdowns))
    assert state is None
    (evict,) = effects
    assert isinstance(evict, lifecycle.Evict)
    assert evict.nodes == ("node3", "node2")
    assert evict.after == "checkpoint"
    _, (one,) = lifecycle.tick(waiting, world(slowdowns, most=1))
    assert isinstance(one, lifecycle.Evict)
    assert one.nodes == ("node3",)
    _, (recovered,) = lifecycle.tick(waiting, world({"node3": 40.0, "node2": 0.0}))
    assert isinstance(recovered, lifecycle.Evict)
    assert recovered.nodes == ("node3",)
    # A partition without room for both (4 nodes, a 3-node job): the second stays.
    small = replace(world(slowdowns), cluster=_world(NOW).cluster)
    _, (room,) = lifecycle.tick(waiting, small)
    assert isinstance(room, lifecycle.Evict)
    assert room.nodes == ("node3",)


def test_nodes_flagged_in_the_same_cycle_go_in_the_same_requeue() -> None:
    """The worst month's class: a 4,096-GPU job with five bad nodes from its first step
    evicted one, waited out its cooldown, evicted another and reached max_requeues with
    three left. A detection decided to evict at once takes the job's other nodes flagged in
    the same cycle (peers) into the same requeue, each on its own verdict."""
    second = replace(_event(), node="node2", ranks=[3], slowdown_pct=25.0, job_loss_pct=15.0)
    base = _world(NOW)
    cluster = ClusterContext(
        nodes=tuple(NodeInfo(f"node{i}", "idle", (), "", ("debug",)) for i in range(1, 7))
    )
    slowdowns = {"node3": 40.0, "node2": 25.0}
    world = replace(
        base,
        cluster=cluster,
        recheck=lambda e, _since: slowdowns.get(e.node),
        peers=lambda: (lifecycle.Candidate(second, 1),),
    )
    state, effects, decision = lifecycle.detected(None, _event(), 1, "d1", world)
    assert state is None
    assert decision.action == "evict"
    (evict,) = effects
    assert isinstance(evict, lifecycle.Evict)
    assert evict.nodes == ("node3", "node2")
    alone = replace(world, peers=lambda: ())
    _, (one,), _ = lifecycle.detected(None, _event(), 1, "d1", alone)
    assert isinstance(one, lifecycle.Evict)
    assert one.nodes == ("node3",)
