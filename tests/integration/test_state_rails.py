"""The service's counters in Redis that the rails read: exact however long the audit grows
(a private redis-server; no cluster)."""

from __future__ import annotations

import redis

from slurm_plugin.detection import StragglerEvent
from slurm_plugin.model import keys
from slurm_plugin.policy.rails import ClusterRails, SafetyPolicy
from slurm_plugin.service.executor import Executor
from slurm_plugin.service.node_rails import NodeRails
from slurm_plugin.service.state import ServiceState
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.conftest import RedisServer, wait_for
from tests.integration.loop_harness import running_job


def _state(server: RedisServer, clock: FakeClock, retention_s: float = 86400) -> ServiceState:
    return ServiceState(
        redis.Redis.from_url(server.url, decode_responses=True), clock, retention_s=retention_s
    )


def test_budget_and_job_decisions_count_past_the_first_thousand_entries(
    private_redis: RedisServer,
) -> None:
    """Issue 13 item 2, reproduced: 1,200 annotations, then 12 evictions. The hourly budget
    counts 12 (it counted 0 when it read only the first 1,000 audit entries), a job's decisions
    are all found, and the audit pages through everything."""
    clock = FakeClock()
    state = _state(private_redis, clock)
    for i in range(1200):
        state.save_decision(f"d-a{i:011d}", {"job_id": "7", "state": "recorded", "node": "n1"})
    for i in range(12):
        decision_id = f"d-e{i:011d}"
        state.save_decision(decision_id, {"job_id": "8", "node": "n2", "state": "planned"})
        state.save_decision(decision_id, {"state": "held"})
        state.save_decision(decision_id, {"state": "verified"})
        clock.advance(1)
    assert state.evictions_since(clock() - 3600) == 12
    assert state.evictions_since(clock() - 5) == 5
    decisions = state.job_decisions("8")
    assert [d["id"] for d in decisions] == [f"d-e{i:011d}" for i in range(12)]
    assert all(d["state"] == "verified" and d["held_ts"] for d in decisions)
    assert len(state.job_decisions("7")) == 1200

    found = state.audit(job_id="8", count=100)
    assert len(found) == 36  # three state changes per eviction, after 1,200 other entries
    first = state.audit(count=1000)
    rest = state.audit(count=1000, after=first[-1]["audit_id"])
    assert len(first) + len(rest) == 1236
    assert {e["audit_id"] for e in first}.isdisjoint(e["audit_id"] for e in rest)


def test_decisions_expire_after_the_retention(private_redis: RedisServer) -> None:
    """Decision hashes and a job's index carry the retention as TTL (they used to live
    forever); evictions older than a week leave the budget's set."""
    clock = FakeClock()
    state = _state(private_redis, clock, retention_s=7200)
    state.save_decision("d-000000000001", {"job_id": "9", "state": "held", "node": "n1"})
    client = redis.Redis.from_url(private_redis.url)
    assert 0 < client.ttl(keys.decision("d-000000000001")) <= 7200
    assert 0 < client.ttl(keys.job_decisions("9")) <= 7200
    clock.advance(keys.EVICTIONS_KEEP_S + 1)
    state.save_decision("d-000000000002", {"job_id": "9", "state": "held", "node": "n1"})
    assert client.zcard(keys.EVICTIONS) == 1
    assert state.evictions_since(0) == 1


def test_the_breaker_window_outlives_a_service_restart(private_redis: RedisServer) -> None:
    """Issue 25: the breaker's window lived in the service's memory, so a restart between
    stragglers closed it. Two nodes flagged, the service restarted, a third flagged within
    the window (max 2): the breaker opens. Nodes flagged again count once; a node flagged
    longer than the window ago does not count."""
    clock = FakeClock()
    state = _state(private_redis, clock)
    rails = ClusterRails(safety=SafetyPolicy(breaker_max_nodes=2, breaker_window_s=600))
    jobs = FakeScheduler([running_job(clock)], [])

    def flag(node_rails: NodeRails, node: str) -> None:
        event = StragglerEvent("5", node, None, [0], 10, clock(), 9.0, 30.0, "compute", "node")
        job = running_job(clock)
        node_rails.remember(event, job, "5.1", rails, (), clock())

    def service() -> NodeRails:  # what a restart builds anew
        return NodeRails(state, Executor(jobs, state, clock=clock), dry_run=True)

    flag(service(), "node1")
    clock.advance(700)  # node1 leaves the window
    first = service()
    flag(first, "node2")
    flag(first, "node3")
    flag(first, "node3")
    assert state.breaker() is None  # two distinct nodes within 600 s: at the maximum
    flag(service(), "node4")  # after a restart
    assert state.breaker() is not None
    assert "3 straggler nodes within 600 s" in (state.breaker() or "")


def test_a_slow_node_the_job_does_not_wait_for_enters_history_not_the_breaker(
    private_redis: RedisServer,
) -> None:
    """Issue 36, classes 5 and 8: a GPU slow for 20 minutes in the faster of two pipeline
    stages (the job waits for the slower stage anyway) is an incident of its node, the first
    step to marking a node slow in two jobs; it is no straggler the service may act on, so
    it never counts towards the breaker (max 1: three such nodes would have opened it)."""
    clock = FakeClock()
    state = _state(private_redis, clock)
    rails = ClusterRails(safety=SafetyPolicy(breaker_max_nodes=1, breaker_window_s=600))
    jobs = FakeScheduler([running_job(clock)], [])
    node_rails = NodeRails(state, Executor(jobs, state, clock=clock), dry_run=True)
    for node in ("node1", "node2", "node3"):
        event = StragglerEvent(
            "5", node, 2, [2], 900, clock(), 9.0, 9.0, "compute", "gpu",
            since_ts=clock() - 1200, job_loss_pct=0.0,
        )  # fmt: skip
        node_rails.remember(event, running_job(clock), "5.1", rails, (), clock(), costless=True)
    assert state.breaker() is None
    (incident,) = state.node_history("node1").incidents
    assert (incident.job_id, incident.lasted_s) == ("5.1", 1200.0)


def test_the_leader_lock_has_one_owner_and_only_the_owner_keeps_or_frees_it(
    private_redis: RedisServer,
) -> None:
    """The lock (redis-py's Lock, the instance name as its token): a second instance cannot
    take it, keep it or free it; the owner keeps it past its first lifetime and frees it; a
    lapsed lock goes to whoever asks next."""
    state = _state(private_redis, FakeClock())
    assert state.lead("a", ttl_s=1.0)
    assert not state.lead("b", ttl_s=1.0)
    assert not state.step_down("b")
    assert state.client.get(keys.LEADER) == "a"  # status shows who leads
    assert state.lead("a", ttl_s=30.0)  # kept, and for longer
    assert int(state.client.pttl(keys.LEADER)) > 20_000
    assert state.leads("a")
    assert not state.leads("b")
    assert state.step_down("a")
    assert not state.step_down("a")  # freed once
    assert state.lead("b", ttl_s=0.2)
    wait_for(lambda: state.client.get(keys.LEADER) is None, 10, "b's lock to lapse")
    assert not state.leads("b")
    assert state.lead("a", ttl_s=1.0)


def test_applied_policies_are_read_from_their_index_and_a_scan_a_minute(
    private_redis: RedisServer,
) -> None:
    """The service reads the applied policies every cycle: from the name index (one SMEMBERS,
    no scan of a keyspace of 100,000 keys), with a scan at its first read and then once a
    minute, which finds a policy a release before the index applied (and mends the index)."""
    clock = FakeClock()
    state = _state(private_redis, clock)
    admin = redis.Redis.from_url(private_redis.url, decode_responses=True)
    state.apply_policy("strict", '{"name": "strict"}')
    assert state.applied_policies() == {"strict": '{"name": "strict"}'}  # the first read scans
    admin.set(keys.policy("older"), '{"name": "older"}')  # applied without the index
    admin.set(f"{keys.PREFIX}policy:not a name", "{}")  # a stray key is not a policy
    admin.config_resetstat()
    for _ in range(3):
        assert state.applied_policies() == {"strict": '{"name": "strict"}'}
        clock.advance(10)
    calls = {name: stat["calls"] for name, stat in admin.info("commandstats").items()}
    assert "cmdstat_scan" not in calls
    assert calls["cmdstat_smembers"] == 3
    clock.advance(30)  # a minute since the scan
    found = state.applied_policies()
    assert found == {"strict": '{"name": "strict"}', "older": '{"name": "older"}'}
    assert admin.smembers(keys.POLICY_NAMES) == {"strict", "older"}
    assert state.revert_policy("strict")
    assert not state.revert_policy("strict")
    assert state.applied_policies() == {"older": '{"name": "older"}'}  # at once, no scan
    admin.delete(keys.policy("older"))  # reverted by a release before the index
    assert state.applied_policies() == {}
