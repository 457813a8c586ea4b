"""Advice before a requeue (issue 40, item 1), pure: the lifecycle's rules under
``recovery = "advice"``, the advice record and what a job may answer, the job's option."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from slurm_plugin.errors import TelemetryError
from slurm_plugin.model.cluster import NodeInfo
from slurm_plugin.policy import lifecycle
from slurm_plugin.policy.decide import JobContext
from slurm_plugin.policy.lifecycle import Advise, Close, Evict, Waiting, World
from slurm_plugin.policy.loader import JobOptions, apply_job_overrides
from slurm_plugin.store import advice, job_state
from tests.scenarios.decisions import BASE_JOB, NODES, NOW, POLICIES
from tests.scenarios.decisions import slowdown as _event
from tests.scenarios.decisions import world as _world


def _advising(now: float = NOW) -> World:
    """The shipped evict policy with advice first; a re-check that finds node3 still slow,
    no checkpoints reported (the verdict is to evict now)."""
    policy = POLICIES["evict"]
    actions = policy.actions.model_copy(update={"recovery": "advice"})
    base = _world(now)
    return replace(
        base,
        policy=policy.model_copy(update={"actions": actions}),
        ctx=JobContext(),
        recheck=lambda _event, _since: 40.0,
    )


def _advised() -> tuple[Waiting, Advise]:
    state, effects, decision = lifecycle.detected(None, _event(), 0, "d1", _advising())
    assert decision.action == "evict"
    assert state is not None
    (given,) = effects
    assert isinstance(given, Advise)
    return state, given


def test_an_eviction_under_advice_first_advises_and_waits() -> None:
    """The verdict to evict becomes advice to leave node3, due by the deadline; the decision
    waits for ``advice``; nothing is requeued yet, and the node flagged again meanwhile does
    not cut the deadline short."""
    state, given = _advised()
    deadline = POLICIES["evict"].actions.advice_deadline_s
    assert (given.nodes, given.deadline_ts) == (("node3",), NOW + deadline)
    assert (state.waiting_for, state.advised, state.since) == ("advice", ("node3",), NOW)
    again, effects, _ = lifecycle.detected(state, _event(), 0, "d2", _advising(NOW + 30))
    assert (again, effects) == (state, [])
    assert lifecycle.tick(state, _advising(NOW + deadline - 1)) == (state, [])


def test_the_job_leaving_every_advised_node_closes_it_without_a_requeue() -> None:
    state, _ = _advised()
    partly = replace(_advising(NOW + 10), acted={"d1": frozenset({"node2"})})
    assert lifecycle.tick(state, partly) == (state, [])
    other = replace(_advising(NOW + 10), acted={"d0": frozenset({"node3"})})
    assert lifecycle.tick(state, other) == (state, [])
    done = replace(_advising(NOW + 10), acted={"d1": frozenset({"node3", "node2"})})
    closed, (close,) = lifecycle.tick(state, done)
    assert closed is None
    assert isinstance(close, Close)
    assert close.acted
    assert "node3" in close.note


def test_advice_not_acted_on_by_its_deadline_is_a_requeue() -> None:
    state, _ = _advised()
    deadline = POLICIES["evict"].actions.advice_deadline_s
    world = replace(_advising(NOW + deadline), advised=frozenset({"node3"}))
    after, (evict,) = lifecycle.tick(state, world)
    assert after is None
    assert isinstance(evict, Evict)
    assert (evict.nodes, evict.after, evict.decision_id) == (("node3",), "advice deadline", "d1")
    # Not even a world that forgot what it advised advises again at the deadline.
    _, (still,) = lifecycle.tick(state, _advising(NOW + deadline))
    assert isinstance(still, Evict)


def test_a_node_advised_before_is_requeued_away_at_once() -> None:
    """The job said it left node3 (or was told to) and node3 is slow in it again: no second
    advice, the requeue."""
    world = replace(_advising(), advised=frozenset({"node3"}))
    state, (evict,), _ = lifecycle.detected(None, _event(), 0, "d3", world)
    assert state is None
    assert isinstance(evict, Evict)
    assert evict.after == "detection"


def test_what_a_job_answers_is_read_narrowly() -> None:
    """Only ``advice_acted`` events with a decision id of ours and a valid node count; the
    rest of what a job writes is ignored."""
    events: list[dict[str, object]] = [
        {"name": "advice_acted", "decision_id": "d-0123456789ab", "node": "node3"},
        {"name": "advice_acted", "decision_id": "d-0123456789ab", "node": "no de;rm"},
        {"name": "advice_acted", "decision_id": "D1; drop", "node": "node3"},
        {"name": "advice_acted", "decision_id": 7, "node": "node3"},
        {"name": "checkpoint_end", "decision_id": "d-0123456789ab", "node": "node2"},
    ]
    assert advice.acted_of(events) == [("d-0123456789ab", "node3")]
    state = job_state.read(
        {"advice_acted": "d1:node3,d1:node2,d2:node1,broken", "advised_nodes": "node3,node2"}
    )
    assert state.acted() == {"d1": frozenset({"node3", "node2"}), "d2": frozenset({"node1"})}
    assert state.advised() == frozenset({"node3", "node2"})


def test_an_advice_record_reads_back_or_is_refused() -> None:
    given = advice.Advice(
        job_id="5", decision_id="d-1", leave=["node3"], issued_ts=NOW, deadline_ts=NOW + 120
    )
    back = advice.decode(given.model_dump_json())
    assert back == given
    assert back.holds(NOW + 119)
    assert not back.holds(NOW + 120)
    for raw in ("{", json.dumps({**given.model_dump(), "version": 2}), '{"version": 1}', "[]"):
        with pytest.raises(TelemetryError):
            advice.decode(raw)


@pytest.mark.parametrize(
    ("given", "recovery"),
    [("advice", "advice"), ("requeue", "requeue"), ("spares", "requeue"), (None, "requeue")],
)
def test_a_job_chooses_its_recovery(given: str | None, recovery: str) -> None:
    """``--straggler-recovery``: the job's launcher is what can act on advice, so the job
    chooses; anything else than the two keeps the policy's."""
    policy = apply_job_overrides(POLICIES["evict"], JobOptions(recovery=given))
    assert policy.actions.recovery == recovery


def test_advice_needs_no_room_for_a_requeue_but_its_requeue_does() -> None:
    """A job on every node of its partition (4 of 4, needing 4): a requeue without node3
    could never start, advice can (the job goes on in its allocation without it). At the
    deadline the requeue's rails decide: no room, so no requeue; and node3 slow again later
    is never requeued into a partition without room either."""
    full = tuple(NodeInfo(n.name, "allocated", (), "", ("debug",)) for n in NODES[:4])
    job = replace(BASE_JOB, nodes=tuple(n.name for n in full), node_count=4)

    def world(now: float, advised: frozenset[str] = frozenset()) -> World:
        base = _advising(now)
        cluster = replace(base.cluster, nodes=full)
        return replace(base, job=job, cluster=cluster, advised=advised)

    state, (given,), _ = lifecycle.detected(None, _event(), 0, "d1", world(NOW))
    assert isinstance(given, Advise)
    assert state is not None
    deadline = NOW + POLICIES["evict"].actions.advice_deadline_s
    closed, (close,) = lifecycle.tick(state, world(deadline, advised=frozenset({"node3"})))
    assert closed is None
    assert isinstance(close, Close)
    assert not close.acted
    assert any("usable nodes" in r for r in close.reasons), close
    again = world(deadline + 60, advised=frozenset({"node3"}))
    _, effects, decision = lifecycle.detected(None, _event(), 0, "d2", again)
    assert decision.action != "evict"
    assert not any(isinstance(e, Evict | Advise) for e in effects)
